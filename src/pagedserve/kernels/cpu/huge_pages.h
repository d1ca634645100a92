// Tensors in transparent huge pages, for weights that are streamed whole (huge_pages.cpp).
#pragma once

#include <torch/extension.h>

namespace pagedserve {

// An uninitialised 1-D tensor of `numel` elements (torch's allocator where mmap fails).
torch::Tensor huge_page_empty(int64_t numel, const torch::TensorOptions& options);

}  // namespace pagedserve
