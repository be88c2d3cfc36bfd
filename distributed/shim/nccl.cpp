// The NCCL backend (the `nccl` feature): CUDA tensors, one GPU per rank. Built against
// the torch wheel's CUDA, NCCL and CCCL headers (the venv's nvidia/ packages).
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "shim.hpp"

c10::intrusive_ptr<c10d::Backend> nestor_c10d_nccl(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int rank, int world,
                                                   std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, options);
}
