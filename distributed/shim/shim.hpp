// Types shared by the shim's two files.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>

struct NestorGroup {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
};

struct NestorWork {
  c10::intrusive_ptr<c10d::Work> work;
};

// The Gloo backend on `store` (gloo.cpp: the only file that needs Gloo's headers). Its
// transport binds the named network interface when `interface` is not empty, else the
// address `host` resolves to when it is a loopback address, else this machine's
// hostname (PyTorch's default).
c10::intrusive_ptr<c10d::Backend> nestor_c10d_gloo(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int rank, int world,
                                                   std::chrono::milliseconds timeout,
                                                   const char* host, const char* interface);

// The NCCL backend on `store` (nccl.cpp, built with the `nccl` feature only).
c10::intrusive_ptr<c10d::Backend> nestor_c10d_nccl(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int rank, int world,
                                                   std::chrono::milliseconds timeout);
