"""Every benchmark of qserve, one module each (`python -m qserve.runtime.benchmark.NAME`),
listed in BENCHMARKS. `python -m qserve.runtime.benchmark.record NAME ARGS...` runs one and
writes its output to docs/generated/NAME.md with the command, date, machine and commit.
"""

# name -> what it measures
BENCHMARKS = {
    "cli": "`qserve bench`: an OpenAI-compatible server under streaming load",
    "compare_llamacpp": "qserve against llama.cpp's server, same model, prompts and threads "
                        "(writes docs/bench-llamacpp.md itself)",
    "reliability": "fuzzing, soak, overload, SIGTERM and interrupted-quantize checks",
    "step": "where one engine step's time goes, in-process",
    "served_decode": "the served decode rate (streaming /v1/completions of `qserve serve`) "
                     "against the engine's in-process step rate, at 1/16/64 streams",
    "kv": "KV bytes per token, tokens per budget, paged-allocation waste, long-context KV held",
    "spec": "speculative decoding: acceptance and speed per proposer",
    "linear": "the CPU linears of one decode step, each path side by side",
    "attention": "one paged decode-attention layer, each implementation",
    "gpu_check": "the Triton kernels on a CUDA device, against float64 references",
    "dispatch": "what one C-kernel call costs by ctypes or as a torch operator",
    "quantize_memory": "peak memory of quantizing random checkpoints of growing depth",
    "gateway_overhead": "what `qserve gateway` adds: latency at a request rate, stream TTFT, "
                        "requests lost when a backend is killed",
    "difficulty_routing": "the gateway's model \"auto\" router on labelled data: share routed "
                          "small, quality against always-large, cost saved",
    "mla_quality": "GQA -> MLA conversion: KV bytes per token against perplexity change and "
                   "greedy agreement, per rank, with and without distillation",
    "mla_attention": "one decode-attention layer at long context: GQA FP8 pools against the "
                     "MLA latent FP8 pool (absorbed form), KV bytes read",
    "structured": "structured outputs and tool calls: validity over a schema corpus, speed "
                  "constrained against unconstrained, compile times, a new schema beside "
                  "16 streams, tool-call validity",
    "semantic_cache": "the gateway's semantic cache: threshold, precision and recall on "
                      "labelled paraphrases and near misses, lookup latency under load",
    "decode_bytes": "what a decode step reads from an artifact's weights, from its "
                    "safetensors headers",
    "kv_handoff": "what a prefill/decode KV hand-off costs for one prompt: bytes and the "
                  "time of each stage, in one process",
    "lm_head_precision": "an artifact's next-token KL and word perplexity with the LM head "
                         "as written and quantized in memory",
    "activation_precision": "an artifact's next-token KL and word perplexity with its "
                            "linears' inputs as written and quantized per token in memory",
    "gate_noise": "how far the eval gates move when nothing is quantized (fp32 compute, "
                  "another thread count)",
    "vllm_parity": "greedy parity with vLLM's CPU build: the same artifact and prompt tokens",
    "fp8_remedies": "(a study) FP8 remedies that act where the error is made: Hadamard "
                    "rotations and the first token, on SmolLM2",
    "llamacpp_build": "(a tool) builds llama.cpp's server once from llama-cpp-python's sdist",
    "echo_backend": "(a tool) a model-free OpenAI-compatible backend for gateway benchmarks",
    "results_index": "(a tool) indexes the reports in docs/generated/ (index.md) and the "
                     "README's results table",
    "cli_reference": "(a tool) renders every qserve command's --help into "
                     "docs/reference/cli.md",
    "record": "runs one of the above and records its output in docs/generated/",
}
