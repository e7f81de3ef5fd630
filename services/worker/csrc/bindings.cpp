// The CPU worker's C++ kernels as one Python extension module (services/worker/cpu_kernels.py).

#include <pybind11/functional.h>

#include "kernels.h"
#include "takeover_pool.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every compute call releases the GIL: a one-call decoder over a long prefill chunk runs for seconds on
  // a slow CPU, and the worker's heartbeat thread (Python) must keep reporting meanwhile. The arguments
  // are converted before the release and the result after it; no kernel touches a Python object, except the
  // decoder's cached_layer callback, which takes the GIL for its call (pybind11's std::function wrapper).
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, "attention of each row over a paged KV cache (fp32, fp16 or int8 storage, CPU)", no_gil);
  m.def("store_kv_", &store_kv_, "write each token's keys and values [tokens, 2, kv_heads, head_dim] into its cache slot (fp32, fp16 or int8 cache, CPU)", no_gil);
  m.def("argmax_rows", &argmax_rows, "torch.argmax(logits, dim=-1) of [rows, vocab] float32 logits (CPU)", no_gil);
  m.def("sample_rows", &sample_rows,
        "a token per row of [rows, vocab] float32 logits: argmax at temperature 0, else top-k, top-p, min-p and an inverse-CDF draw "
        "with the row's uniform (CPU)", no_gil);
  m.def("sampling_thresholds", &sampling_thresholds,
        "tests: each row's smallest kept logit / temperature under top-k, top-p and min-p (-inf: all kept; NaN: greedy or no distribution)", no_gil);
  m.def("logprobs_rows", &logprobs_rows,
        "(chosen, top values, top ids, ok): each row's log_softmax at its token and its k largest, best first; ok false: a row with NaN or "
        "no finite logit, left unwritten (CPU)", no_gil);
  m.def("block_quant_gemm", &block_quant_gemm, "x @ dequantized(q4_0, q4_1 or q8_0 panels).T (+ bias) (+ residual), x rounded to int16 or int8 per block of 32 (CPU)", no_gil);
  m.def("block_quant_gemm_isa", &block_quant_gemm_isa,
        "the instructions of block_quant_gemm's integer block products: avx512-vnni, avx2 (also where TOKENYARD_CPU_VNNI=0) or portable");
  m.def("set_block_quant_pair_min_rows", &set_block_quant_pair_min_rows,
        "VNNI builds: block_quant_gemm's and grouped_moe's calls of at least this many rows take two panels per 512-bit tile (0: never)");
  m.def("block_quant_pair_min_rows", &block_quant_pair_min_rows, "from how many rows a call takes two panels per 512-bit tile (0: never)");
  m.def("block_quant_wide_product_rate", &block_quant_wide_product_rate,
        "this core's 512-bit VNNI products per second over its 256-bit ones, measured (~2 ms; 0 where the build has no VNNI)");
  m.def("set_weight_prefetch_keep", &set_weight_prefetch_keep,
        "block_quant_gemm prefetches the weights into every cache level (true: where the last-level cache holds them) or non-temporally "
        "(false, the default: they stream from memory past the caches)");
  m.def("weight_prefetch_keep", &weight_prefetch_keep, "whether block_quant_gemm's weight prefetch keeps the weights in the caches");
  m.def("grouped_moe", &grouped_moe,
        "a MoE layer over q4_0 / q4_1 / q8_0 expert panels in one call: route (softmax, top-k), every active expert's SwiGLU and the weighted "
        "sum added into residual in place (or a new tensor), with a shared expert gated by the router logits' last column (fp32, CPU)",
        py::arg("x"), py::arg("router_logits"), py::arg("top_k"), py::arg("renormalize"), py::arg("gate_up"), py::arg("down"),
        py::arg("shared_gate_up") = py::none(), py::arg("shared_down") = py::none(), py::arg("residual") = py::none(), py::arg("activation_bits") = 16,
        py::arg("topk_weights") = py::none(), py::arg("topk_ids") = py::none(), py::arg("expert_slots") = py::none(), no_gil);
  m.def("router_logits", &router_logits, "x [T, H] @ weight [E, H].T in float32, each dot product in one fixed order (CPU)", no_gil);
  m.def("route_experts", &route_experts,
        "(weights [T, k] float32, ids [T, k] int32): grouped_moe's own routing of the first num_experts columns (-1: all) of [T, E] float32 "
        "router logits (softmax, top-k, ties to the lower expert, optionally renormalised)",
        py::arg("router_logits"), py::arg("top_k"), py::arg("renormalize"), py::arg("num_experts") = -1, no_gil);
  m.def("int8_linear", &int8_linear, "x @ (int8 weight * per-channel scale).T (+ bias), fp32 arithmetic (CPU)", no_gil);
  m.def("add_rms_norm", &add_rms_norm, "(RMSNorm(h) * weight, h) with h = x + residual written over x (fp32, CPU)", no_gil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [gate | up] rows (fp32, CPU)", no_gil);
  py::class_<DecoderLayers>(m, "DecoderLayers", "a decoder's layers over weights in blocks, held from load, run for a step in one call (fp32, CPU)")
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<std::optional<torch::Tensor>>, std::vector<std::optional<torch::Tensor>>,
                    std::vector<torch::Tensor>, std::vector<std::optional<torch::Tensor>>, std::vector<std::optional<torch::Tensor>>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, std::vector<std::optional<torch::Tensor>>, std::vector<std::vector<int64_t>>, int64_t, int64_t, bool,
                    int64_t, int64_t, int64_t, double, std::vector<std::optional<torch::Tensor>>, std::vector<std::optional<torch::Tensor>>, int64_t>(),
           py::arg("norms"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("head_norms"), py::arg("o_proj"), py::arg("o_bias"), py::arg("routers"),
           py::arg("gate_up"), py::arg("down"), py::arg("slot_maps"), py::arg("many_row_bits"), py::arg("few_rows"), py::arg("top_k"), py::arg("renormalize"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("predictors") = std::vector<std::optional<torch::Tensor>>{},
           py::arg("predicted_maps") = std::vector<std::optional<torch::Tensor>>{}, py::arg("predicted_k") = 0)
      .def("forward", &DecoderLayers::forward, "final-normed hidden states [rows, hidden] of a step's embedded rows, every layer in one call",
           py::arg("embedded"), py::arg("caches"), py::arg("cos"), py::arg("sin"), py::arg("write_slots"), py::arg("block_tables"), py::arg("context_lens"),
           py::arg("block_size"), py::arg("bank") = py::none(), py::arg("cached_layer") = py::none(), py::arg("read_ahead") = true, no_gil)
      .def("take_bank_hits", &DecoderLayers::take_bank_hits,
           "the (layer, experts, seconds) of the layer-steps that ran from the expert cache's bank since the last call, in order");
  py::class_<DirectReads>(m, "DirectReads", "reads of an O_DIRECT file in flight while the caller computes (Linux native AIO, no threads)")
      .def(py::init<int64_t>(), py::arg("depth"))
      .def("submit", &DirectReads::submit, "queue reads (offset, buffer addresses) of nbytes a buffer in one call; each one's ticket, or -errno",
           py::arg("fd"), py::arg("reads"), py::arg("nbytes"))
      .def("wait", &DirectReads::wait, "(bytes read or -errno, whether it had to be waited for) of a ticket's read", py::arg("ticket"), no_gil)
      .def_property_readonly("in_flight", &DirectReads::in_flight);
  m.def(
      "takeover_pool_stats",
      [] {
        auto& s = takeover_pool::stats();
        return std::map<std::string, uint64_t>{{"jobs", s.jobs.load()}, {"items", s.items.load()}, {"taken_over", s.taken_over.load()}};
      },
      "what the pool of few-row calls has run: jobs, their items, and the items taken over from a helper that was not running");
  m.def(
      "set_takeover_pool",
      [](bool on, int64_t max_rows) {
        TORCH_CHECK(max_rows >= 1 && max_rows <= takeover_pool::MAX_ROWS, "the pool takes calls of 1 to ", takeover_pool::MAX_ROWS, " rows, not ", max_rows);
        takeover_pool::max_rows().store(max_rows);
        takeover_pool::enabled().store(on);
      },
      "few-row products and attention (calls of up to max_rows rows) on the takeover pool (on) or on OpenMP's threads (off, the default)",
      py::arg("on"), py::arg("max_rows") = takeover_pool::MAX_ROWS);
  m.attr("TAKEOVER_POOL_MAX_ROWS") = takeover_pool::MAX_ROWS;
  m.def(
      "set_takeover_helper_stall_us", [](int64_t us) { takeover_pool::stats().helper_stall_us.store(us); },
      "tests: each pool helper stalls this long before committing an item (0: never), as a preemption would");
  m.def("rms_norm_heads_", &rms_norm_heads_, "RMSNorm each head of x [tokens, heads, head_dim] in place by its row of weight [heads, head_dim] (fp32, CPU)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), no_gil);
  m.def("rotary_", &rotary_, "rotate x [tokens, heads, rotary_dim] in place by cos/sin [tokens, 1, rotary_dim] (fp32, CPU)", no_gil);
}
