// What tch does not expose of libtorch's autograd: setting a leaf's `.grad()`, and the
// tensor a view is a view of.
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

// A new handle to the tensor `view` is a view of (the root of its views), or null when
// it is none or libtorch threw.
extern "C" at::Tensor* nestor_view_base(const at::Tensor* view) {
  try {
    if (!view->is_view()) {
      return nullptr;
    }
    return new at::Tensor(view->_base());
  } catch (...) {
    return nullptr;
  }
}
