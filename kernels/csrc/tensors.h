// What the ops need of tensors beyond `torch/csrc/stable/tensor.h`, shared by every op: an
// fp32 output allocated by the C shim's direct call (the stable `empty` and `new_empty` go
// through the dispatcher's boxed calling convention, which cost a small op a microsecond),
// and a shape written out for error messages.

#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

namespace tierserve {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// A new contiguous fp32 tensor of `sizes` on the CPU.
inline Tensor empty_float(std::initializer_list<int64_t> sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= sizes.begin()[d];
  }
  AtenTensorHandle handle;
  STD_TORCH_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.begin(),
                                           strides.data(), aoti_torch_dtype_float32(),
                                           aoti_torch_device_type_cpu(), 0,
                                           &handle) == AOTI_TORCH_SUCCESS,
                  "could not allocate the output");
  return Tensor(handle);
}

// A tensor's shape as "[2, 3]".
inline std::string shape(const Tensor& t) {
  std::ostringstream out;
  out << "[";
  for (int64_t d = 0; d < t.dim(); ++d) out << (d ? ", " : "") << t.size(d);
  out << "]";
  return out.str();
}

}  // namespace tierserve
