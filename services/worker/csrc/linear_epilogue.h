// The block-quantized GEMM's epilogue: the optional bias [out] and residual [rows, out] that are added to
// a product, checked and made contiguous (fp32, CPU).
#pragma once

#include <torch/extension.h>

#include <optional>

struct LinearEpilogue {
  std::optional<torch::Tensor> bias, residual;  // contiguous copies (or the tensors themselves)

  LinearEpilogue(const std::optional<torch::Tensor>& b, const std::optional<torch::Tensor>& r, int64_t rows, int64_t out_features) {
    if (b.has_value()) {
      TORCH_CHECK(b->dim() == 1 && b->size(0) == out_features && b->scalar_type() == torch::kFloat32, "one float32 bias per output channel");
      bias = b->contiguous();
    }
    if (r.has_value()) {
      TORCH_CHECK(r->dim() == 2 && r->size(0) == rows && r->size(1) == out_features && r->scalar_type() == torch::kFloat32,
                  "residual must be [rows, out] float32");
      residual = r->contiguous();
    }
  }
  const float* bias_ptr() const { return bias.has_value() ? bias->data_ptr<float>() : nullptr; }
  const float* residual_ptr() const { return residual.has_value() ? residual->data_ptr<float>() : nullptr; }
};
