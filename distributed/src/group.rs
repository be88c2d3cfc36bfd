//! A process group on c10d: a TCPStore for rendezvous and the Gloo backend for CPU
//! tensors, formed from torchrun's environment or an explicit configuration.

use std::ffi::CString;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::time::Duration;

use tch::{Device, Kind, Tensor};

use crate::error::{DistributedError, Result};
use crate::ffi;

/// How a collective combines the ranks' tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
}

impl ReduceOp {
    fn code(self) -> i32 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Max => 1,
            ReduceOp::Min => 2,
        }
    }
}

/// The c10d backend that runs a group's collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Gloo: CPU tensors, over TCP.
    Gloo,
    /// NCCL: CUDA tensors, one GPU per rank (the `nccl` feature).
    Nccl,
}

impl Backend {
    /// Whether a tensor on `device` suits this backend.
    fn takes(self, device: Device) -> bool {
        match self {
            Backend::Gloo => device == Device::Cpu,
            Backend::Nccl => matches!(device, Device::Cuda(_)),
        }
    }
}

/// Where and how a process joins its group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupConfig {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// The number of processes.
    pub world_size: usize,
    /// The store's host (torchrun's `MASTER_ADDR`).
    pub host: String,
    /// The store's port (torchrun's `MASTER_PORT`).
    pub port: u16,
    /// Whether this process serves the store (rank 0 without torchrun's agent store).
    pub serve_store: bool,
    /// How long joining and every collective may wait for the other ranks.
    pub timeout: Duration,
    /// The network interface Gloo binds (`GLOO_SOCKET_IFNAME`); by default the
    /// loopback address for a loopback host, else the address of this machine's hostname.
    pub interface: Option<String>,
    /// Gloo (CPU tensors, the default) or NCCL (CUDA tensors).
    pub backend: Backend,
}

/// How long a group waits for its ranks unless told otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

impl GroupConfig {
    /// Rank `rank` of `world_size` with the store at `host:port`, served by rank 0.
    pub fn new(rank: usize, world_size: usize, host: impl Into<String>, port: u16) -> Self {
        Self {
            rank,
            world_size,
            host: host.into(),
            port,
            serve_store: rank == 0,
            timeout: DEFAULT_TIMEOUT,
            interface: None,
            backend: Backend::Gloo,
        }
    }

    /// The configuration torchrun gives its processes: `RANK`, `WORLD_SIZE`,
    /// `MASTER_ADDR`, `MASTER_PORT`; with `TORCHELASTIC_USE_AGENT_STORE=True` every
    /// rank is a client of the agent's store. `GLOO_SOCKET_IFNAME` names the interface.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`GroupConfig::from_env`] with the variables `var` gives.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        fn parsed<T: std::str::FromStr>(
            var: &impl Fn(&str) -> Option<String>,
            variable: &'static str,
        ) -> Result<T>
        where
            T::Err: std::fmt::Display,
        {
            let text = var(variable).ok_or(DistributedError::Config {
                variable,
                problem: "is not set (start the processes with torchrun, or set it)".into(),
            })?;
            text.trim()
                .parse()
                .map_err(|error: T::Err| DistributedError::Config {
                    variable,
                    problem: format!("is {text:?}: {error}"),
                })
        }
        let rank: usize = parsed(&var, "RANK")?;
        let world_size: usize = parsed(&var, "WORLD_SIZE")?;
        let host: String = parsed(&var, "MASTER_ADDR")?;
        let port: u16 = parsed(&var, "MASTER_PORT")?;
        let agent_store = var("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|value| value.eq_ignore_ascii_case("true"));
        let mut config = Self::new(rank, world_size, host, port);
        config.serve_store = rank == 0 && !agent_store;
        config.interface = var("GLOO_SOCKET_IFNAME").filter(|name| !name.is_empty());
        config.checked()
    }

    /// This configuration with the `backend` that runs the collectives.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// This configuration with `timeout` for joining and for every collective.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn checked(self) -> Result<Self> {
        let config =
            |variable, problem: String| Err(DistributedError::Config { variable, problem });
        if self.world_size == 0 || self.world_size > i32::MAX as usize {
            return config("WORLD_SIZE", format!("is {}: 1 or more", self.world_size));
        }
        if self.rank >= self.world_size {
            return config(
                "RANK",
                format!("is {}, not below WORLD_SIZE {}", self.rank, self.world_size),
            );
        }
        if self.timeout.is_zero() || self.timeout.as_millis() > i64::MAX as u128 {
            return config("timeout", format!("is {:?}", self.timeout));
        }
        Ok(self)
    }
}

/// A group of processes that run collectives together (c10d's Gloo backend: CPU
/// tensors). Every rank makes the same calls in the same order.
///
/// ```no_run
/// use nestor_distributed::{ProcessGroup, ReduceOp};
///
/// // Started by `torchrun --nproc-per-node 2 --no-python <binary>`.
/// let group = ProcessGroup::from_env()?;
/// let x = tch::Tensor::from_slice(&[group.rank() as f32 + 1.0]);
/// group.all_reduce(&x, ReduceOp::Sum)?.wait()?;
/// assert_eq!(x.double_value(&[0]), 3.0); // 1 + 2 on 2 ranks
/// # Ok::<(), nestor_distributed::DistributedError>(())
/// ```
pub struct ProcessGroup {
    raw: NonNull<ffi::Group>,
    rank: usize,
    world_size: usize,
    backend: Backend,
}

// SAFETY: c10d's backends are used from any thread (PyTorch's DDP launches collectives
// from autograd's threads); the handle is only freed on drop.
unsafe impl Send for ProcessGroup {}

impl ProcessGroup {
    /// Joins the group `config` describes: connects to (or serves) the store and
    /// forms the Gloo backend with every rank, waiting at most the timeout.
    pub fn new(config: &GroupConfig) -> Result<Self> {
        let config = config.clone().checked()?;
        let text = |variable, value: &str| {
            CString::new(value).map_err(|_| DistributedError::Config {
                variable,
                problem: format!("{value:?} has a NUL byte"),
            })
        };
        let host = text("MASTER_ADDR", &config.host)?;
        let interface = text(
            "GLOO_SOCKET_IFNAME",
            config.interface.as_deref().unwrap_or(""),
        )?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the strings outlive the call; `raw` receives a new group or stays null.
        let message = unsafe {
            ffi::nestor_c10d_group(
                host.as_ptr(),
                config.port,
                config.serve_store,
                config.rank as i32,
                config.world_size as i32,
                config.timeout.as_millis() as i64,
                interface.as_ptr(),
                i32::from(config.backend == Backend::Nccl),
                &mut raw,
            )
        };
        let join_error = |message: String| DistributedError::Join {
            rank: config.rank,
            world_size: config.world_size,
            address: format!("{}:{}", config.host, config.port),
            message,
        };
        if let Some(message) = ffi::taken_message(message) {
            return Err(join_error(message));
        }
        let raw = NonNull::new(raw).ok_or_else(|| join_error("no group was made".into()))?;
        Ok(Self {
            raw,
            rank: config.rank,
            world_size: config.world_size,
            backend: config.backend,
        })
    }

    /// Joins the group torchrun's environment describes ([`GroupConfig::from_env`]).
    pub fn from_env() -> Result<Self> {
        Self::new(&GroupConfig::from_env()?)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of processes.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The backend that runs the collectives.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Launches the reduction of `tensor` over the ranks, in place; it is done when the
    /// returned [`Pending`] is waited for. `tensor`: contiguous, on the CPU (Gloo) or a
    /// GPU (NCCL), the same shape and kind on every rank.
    pub fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Pending<'_>> {
        self.launch("all_reduce", tensor, |raw, tensor, out| unsafe {
            ffi::nestor_c10d_all_reduce(raw, tensor, op.code(), out)
        })
    }

    /// Launches the copy of rank `root`'s `tensor` into every rank's, in place.
    pub fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Pending<'_>> {
        if root >= self.world_size {
            return Err(DistributedError::Invalid(format!(
                "broadcast from rank {root} in a group of {}",
                self.world_size
            )));
        }
        self.launch("broadcast", tensor, |raw, tensor, out| unsafe {
            ffi::nestor_c10d_broadcast(raw, tensor, root as i32, out)
        })
    }

    /// Runs `launch` on a shallow clone of `tensor` (kept alive by the [`Pending`]).
    fn launch(
        &self,
        operation: &'static str,
        tensor: &Tensor,
        launch: impl FnOnce(
            *mut ffi::Group,
            *mut torch_sys::C_tensor,
            *mut *mut ffi::Work,
        ) -> *mut std::ffi::c_char,
    ) -> Result<Pending<'_>> {
        let kind = tensor.f_kind()?;
        if !self.backend.takes(tensor.device())
            || !tensor.is_contiguous()
            || !matches!(
                kind,
                Kind::Float | Kind::Double | Kind::Int64 | Kind::BFloat16 | Kind::Half
            )
        {
            let place = match self.backend {
                Backend::Gloo => "CPU",
                Backend::Nccl => "CUDA",
            };
            return Err(DistributedError::Invalid(format!(
                "{operation} on {:?} takes contiguous {place} tensors of floats or i64: got \
                 {kind:?} on {:?}{}",
                self.backend,
                tensor.device(),
                if tensor.is_contiguous() {
                    ""
                } else {
                    ", not contiguous"
                }
            )));
        }
        let mut tensor = tensor.shallow_clone();
        let mut work = std::ptr::null_mut();
        // `launch` passes the group, the tensor (alive in the `Pending`) and the out slot
        // to one shim call.
        let message = launch(self.raw.as_ptr(), tensor.as_mut_ptr(), &mut work);
        if let Some(message) = ffi::taken_message(message) {
            return Err(self.collective_error(operation, message));
        }
        let work = NonNull::new(work)
            .ok_or_else(|| self.collective_error(operation, "no work was launched".into()))?;
        Ok(Pending {
            work: Some(work),
            operation,
            rank: self.rank,
            _tensor: tensor,
            _group: PhantomData,
        })
    }

    fn collective_error(&self, operation: &'static str, message: String) -> DistributedError {
        DistributedError::Collective {
            rank: self.rank,
            operation,
            message,
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: made by `nestor_c10d_group`, freed once; pending work borrows the group.
        unsafe { ffi::nestor_c10d_group_free(self.raw.as_ptr()) }
    }
}

/// A launched collective; [`Pending::wait`] blocks until it is done (dropping it without
/// waiting leaves it to finish in the background).
#[must_use = "a collective's result is only there after `wait`"]
pub struct Pending<'g> {
    work: Option<NonNull<ffi::Work>>,
    operation: &'static str,
    rank: usize,
    _tensor: Tensor,
    _group: PhantomData<&'g ProcessGroup>,
}

impl Pending<'_> {
    /// Waits until the collective is done on this rank (its tensor holds the result), or
    /// failed: a rank died or did not take part within the group's timeout.
    pub fn wait(mut self) -> Result<()> {
        let Some(work) = self.work.take() else {
            return Ok(());
        };
        // SAFETY: a live work handle, freed right after.
        let message = unsafe { ffi::nestor_c10d_wait(work.as_ptr()) };
        unsafe { ffi::nestor_c10d_work_free(work.as_ptr()) };
        match ffi::taken_message(message) {
            None => Ok(()),
            Some(message) => Err(DistributedError::Collective {
                rank: self.rank,
                operation: self.operation,
                message,
            }),
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if let Some(work) = self.work.take() {
            // SAFETY: a live work handle, freed once (c10d keeps its own reference while
            // the collective runs).
            unsafe { ffi::nestor_c10d_work_free(work.as_ptr()) }
        }
    }
}
