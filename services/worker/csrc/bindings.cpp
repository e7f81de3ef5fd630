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
                    int64_t, int64_t, int64_t, double, std::vector<std::optional<torch::Tensor>>, std::vector<std::optional<torch::Tensor>>, int64_t,
                    std::vector<int64_t>>(),
           py::arg("norms"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("head_norms"), py::arg("o_proj"), py::arg("o_bias"), py::arg("routers"),
           py::arg("gate_up"), py::arg("down"), py::arg("slot_maps"), py::arg("many_row_bits"), py::arg("few_rows"), py::arg("top_k"), py::arg("renormalize"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("predictors") = std::vector<std::optional<torch::Tensor>>{},
           py::arg("predicted_maps") = std::vector<std::optional<torch::Tensor>>{}, py::arg("predicted_k") = 0,
           py::arg("cache_layers") = std::vector<int64_t>{})
      .def("forward", &DecoderLayers::forward, "final-normed hidden states [rows, hidden] of a step's embedded rows, every layer in one call",
           py::arg("embedded"), py::arg("caches"), py::arg("cos"), py::arg("sin"), py::arg("write_slots"), py::arg("block_tables"), py::arg("context_lens"),
           py::arg("block_size"), py::arg("bank") = py::none(), py::arg("cached_layer") = py::none(), py::arg("read_ahead") = true,
           py::arg("expert_bank") = nullptr, no_gil);
  py::class_<DirectReads>(m, "DirectReads", "reads of an O_DIRECT file in flight while the caller computes (Linux native AIO, no threads)")
      .def(py::init<int64_t>(), py::arg("depth"))
      .def("submit", &DirectReads::submit, "queue reads (offset, buffer addresses) of nbytes a buffer in one call; each one's ticket, or -errno",
           py::arg("fd"), py::arg("reads"), py::arg("nbytes"))
      .def("wait", &DirectReads::wait, "(bytes read or -errno, whether it had to be waited for) of a ticket's read", py::arg("ticket"), no_gil)
      .def_property_readonly("in_flight", &DirectReads::in_flight);
  py::register_exception_translator([](std::exception_ptr raised) {
    try {
      if (raised) std::rethrow_exception(raised);
    } catch (const StoreReadError& e) {
      PyErr_SetObject(PyExc_OSError, py::make_tuple(e.code().value(), e.what()).ptr());
    }
  });
  py::class_<ExpertBank::LayerStep>(m, "LayerStep", "one MoE layer-step over the expert cache's bank, as its policy hears of it")
      .def_readonly("layer", &ExpertBank::LayerStep::layer, "its MoE layer (-1: reads ahead that landed between layer-steps)")
      .def_readonly("experts", &ExpertBank::LayerStep::experts, "the experts it routed to, ascending")
      .def_readonly("filled", &ExpertBank::LayerStep::filled, "whether it went through fill (else every expert was held)")
      .def_readonly("fills", &ExpertBank::LayerStep::fills, "(expert, slot, evicted layer, evicted expert; -1, -1: a free slot) of its misses")
      .def_readonly("ahead_layer", &ExpertBank::LayerStep::ahead_layer, "the layer of its reads ahead (-1: none)")
      .def_readonly("reserved", &ExpertBank::LayerStep::reserved, "(expert, slot, evicted layer, evicted expert) read ahead for ahead_layer")
      .def_readonly("dropped", &ExpertBank::LayerStep::dropped, "(layer, expert) whose read failed: its slot is free again")
      .def_readonly("bytes", &ExpertBank::LayerStep::bytes, "bytes read for its misses")
      .def_readonly("landed", &ExpertBank::LayerStep::landed, "experts read ahead that landed as it began")
      .def_readonly("used", &ExpertBank::LayerStep::used, "of those, the ones it routed to")
      .def_readonly("fill_seconds", &ExpertBank::LayerStep::fill_seconds, "its fill's time")
      .def_readonly("seconds", &ExpertBank::LayerStep::seconds, "its layer's call, where the one-call decoder ran it (else 0)");
  py::class_<ExpertBank>(m, "ExpertBank", "the expert cache's slot maps, its layer-steps' fills from the store and their log (CPU)")
      .def(py::init<DirectReads*, int64_t, int64_t, const torch::Tensor&, std::vector<torch::Tensor>>(), py::arg("reads"), py::arg("fd"),
           py::arg("record"), py::arg("records"), py::arg("slot_maps"), py::keep_alive<1, 2>())
      .def("begin", &ExpertBank::begin, "a step begins under LRU: the free slots (taken from the back) and the held ones, least recently used first",
           py::arg("free"), py::arg("ranked"))
      .def("begin_lfu", &ExpertBank::begin_lfu, "a step begins under LFU: the free slots (taken from the back), each slot's uses and last use, and the "
           "policy's step, layer and passes", py::arg("free"), py::arg("count"), py::arg("last"), py::arg("step"), py::arg("layer"), py::arg("passes"),
           py::arg("aging_passes"))
      .def("fill", &ExpertBank::fill, "makes a layer's experts (ascending) resident and starts reading ahead_layer's experts ahead behind them; logged",
           py::arg("layer"), py::arg("experts"), py::arg("ahead_layer") = -1, py::arg("ahead") = std::vector<int64_t>{}, py::return_value_policy::copy, no_gil)
      .def("land_all", &ExpertBank::land_all, "waits for the reads ahead in flight and maps what they read (logged)", no_gil)
      .def("take_log", &ExpertBank::take_log, "every layer-step since the last call, in order")
      .def("fail_reads_of", &ExpertBank::fail_reads_of, "tests: the reads of these (layer, first expert) runs fail with EIO", py::arg("runs"))
      .def_property_readonly("fills", &ExpertBank::fills, "whether it reads (else Python fills the bank)")
      .def_property_readonly("slots", &ExpertBank::slots)
      .def_property_readonly("runs_read", &ExpertBank::runs_read, "reads queued so far, each a run of adjacent records")
      .def("lfu_state", &ExpertBank::lfu_state, "(count, last, step, layer, passes): the LFU state it has kept since begin_lfu");
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
