// What tch does not expose of libtorch's autograd: setting a leaf's `.grad()`.
#include <ATen/core/Tensor.h>

// Makes `gradient` the `.grad()` of `param` (no copy: both then share `gradient`'s
// values), as autograd's accumulation does for a leaf whose gradient is undefined and an
// incoming gradient nobody else holds. 0 on success, 1 if libtorch threw (a tensor
// without autograd metadata, say).
extern "C" int nestor_set_grad(const at::Tensor* param, const at::Tensor* gradient) {
  try {
    param->mutable_grad() = *gradient;
    return 0;
  } catch (...) {
    return 1;
  }
}
