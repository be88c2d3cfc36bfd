// nestor's C ABI over c10d, PyTorch's distributed engine: a TCPStore (wrapped in a
// PrefixStore, as torch.distributed does), a backend made by `nestor_c10d_gloo`
// (gloo.cpp), and collectives through the virtual `c10d::Backend` interface. Every
// function catches C++ exceptions and returns their message (malloc'd; null on success).
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#include "shim.hpp"

namespace {

char* message_of(const char* what) {
  char* copy = static_cast<char*>(std::malloc(std::strlen(what) + 1));
  if (copy != nullptr) {
    std::strcpy(copy, what);
  }
  return copy;
}

template <typename F>
char* guarded(F&& body) {
  try {
    body();
    return nullptr;
  } catch (const c10::Error& error) {
    return message_of(error.what_without_backtrace());
  } catch (const std::exception& error) {
    return message_of(error.what());
  } catch (...) {
    return message_of("an unknown C++ exception");
  }
}

c10d::ReduceOp reduce_op(int op) {
  switch (op) {
    case 1:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case 2:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
    default:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
  }
}

char* launched(c10::intrusive_ptr<c10d::Work> work, NestorWork** out) {
  *out = new NestorWork{std::move(work)};
  return nullptr;
}

}  // namespace

extern "C" {

char* nestor_c10d_group(const char* host, uint16_t port, bool serve, int rank,
                        int world, int64_t timeout_ms, const char* interface, int nccl,
                        NestorGroup** out) {
  *out = nullptr;
  return guarded([&] {
    c10d::TCPStoreOptions options;
    options.port = port;
    options.isServer = serve;
    options.numWorkers = static_cast<std::size_t>(world);
    // Every rank counts itself in (the server waits for them all), as PyTorch's do.
    options.waitWorkers = true;
    options.timeout = std::chrono::milliseconds(timeout_ms);
    c10::intrusive_ptr<c10d::Store> store =
        c10::make_intrusive<c10d::TCPStore>(host, options);
    store = c10::make_intrusive<c10d::PrefixStore>("default_pg", store);
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10::intrusive_ptr<c10d::Backend> backend;
    if (nccl != 0) {
#ifdef NESTOR_WITH_NCCL
      backend = nestor_c10d_nccl(store, rank, world, timeout);
#else
      throw std::runtime_error(
          "nestor-distributed was built without NCCL (build it with the `nccl` feature)");
#endif
    } else {
      backend = nestor_c10d_gloo(store, rank, world, timeout, host, interface);
    }
    *out = new NestorGroup{store, backend};
  });
}

char* nestor_c10d_all_reduce(NestorGroup* group, at::Tensor* tensor, int op,
                             NestorWork** out) {
  *out = nullptr;
  return guarded([&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = reduce_op(op);
    launched(group->backend->allreduce(tensors, options), out);
  });
}

char* nestor_c10d_broadcast(NestorGroup* group, at::Tensor* tensor, int root,
                            NestorWork** out) {
  *out = nullptr;
  return guarded([&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    launched(group->backend->broadcast(tensors, options), out);
  });
}

char* nestor_c10d_wait(NestorWork* work) {
  return guarded([&] { work->work->wait(); });
}

void nestor_c10d_work_free(NestorWork* work) { delete work; }

void nestor_c10d_group_free(NestorGroup* group) { delete group; }

void nestor_c10d_string_free(char* message) { std::free(message); }

}  // extern "C"
