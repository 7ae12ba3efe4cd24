"""Output drift of int8 snapshots on the tiny models (transformers, fp32).

For each architecture and prompt: prefill a prefix of K tokens, take the recurrent states at K
(conv + SSM of every recurrent layer), then continue (the rest of the prompt, then greedy
generation) from (a) the exact states, (b) the states after an int8 round trip through our ops
(`snapshot_quantize_int8` / `snapshot_dequantize_int8`, per-head / per-channel scales) and
(c) for scale, a bf16 round trip. KV of attention layers is untouched. Reports the fraction of
generated tokens that differ from (a), the first divergence, and the change of the log-prob of
(a)'s tokens while the outputs still agree.

Run:  .venv/bin/python benchmarks/int8_drift.py [--prompts 8] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from vllm_hybrid.ops import int8_pool_like, snapshot_dequantize_int8, snapshot_quantize_int8
from vllm_hybrid.testing import cpu_archs
from vllm_hybrid.testing.fixtures import tiny_model_dir

PAIR = torch.tensor([[0, 0]])


def recurrent_states(cache) -> list[torch.Tensor]:
    states = []
    for layer in cache.layers:
        for name in ("conv_states", "recurrent_states"):
            states.extend(t for t in getattr(layer, name, {}).values() if torch.is_tensor(t))
    return states


STATE_ERRORS: dict[str, list[float]] = {"int8": [], "bf16": []}


def _record(name: str, before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    num = sum(float((a - b).norm()) ** 2 for a, b in zip(after, before, strict=True))
    den = sum(float(b.norm()) ** 2 for b in before)
    STATE_ERRORS[name].append((num / den) ** 0.5)


def int8_round_trip(states: list[torch.Tensor]) -> None:
    before = [s.clone() for s in states]
    q, scales = int8_pool_like(states, blocks=1)
    snapshot_quantize_int8(states, q, scales, PAIR)
    snapshot_dequantize_int8(q, scales, states, PAIR)
    _record("int8", before, states)


def bf16_round_trip(states: list[torch.Tensor]) -> None:
    before = [s.clone() for s in states]
    for s in states:
        s.copy_(s.to(torch.bfloat16).float())
    _record("bf16", before, states)


@torch.no_grad()
def continue_from(model, prompt, k, new_tokens, perturb):
    """Greedy tokens and their log-probs after resuming at k with perturbed states."""
    out = model(torch.tensor([prompt[:k]]), use_cache=True)
    cache = out.past_key_values
    if perturb is not None:
        perturb(recurrent_states(cache))
    logits = None
    for tok in prompt[k:]:
        out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
        logits = out.logits[0, -1]
    tokens, logprobs = [], []
    for _ in range(new_tokens):
        lp = torch.log_softmax(logits.float(), -1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(lp)
        out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
        logits = out.logits[0, -1]
    return tokens, logprobs


def compare(ref, got):
    (ref_tok, ref_lp), (tok, lp) = ref, got
    diff = [a != b for a, b in zip(ref_tok, tok, strict=True)]
    first = diff.index(True) if any(diff) else len(diff)
    dlp = [abs(float(lp[i][ref_tok[i]] - ref_lp[i][ref_tok[i]])) for i in range(first)]
    return sum(diff) / len(diff), first, max(dlp, default=0.0)


def run_arch(arch, root, prompts, k, tail, new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir(arch, root), dtype=torch.float32
    ).eval()
    g = torch.Generator().manual_seed(0)
    rows = {"int8": [], "bf16": []}
    for _ in range(prompts):
        prompt = torch.randint(10, 2000, (k + tail,), generator=g).tolist()
        ref = continue_from(model, prompt, k, new_tokens, None)
        for name, fn in (("int8", int8_round_trip), ("bf16", bf16_round_trip)):
            rows[name].append(compare(ref, continue_from(model, prompt, k, new_tokens, fn)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--tail", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    print(
        f"{'arch':>17} {'snapshot':>8} {'tokens changed':>15} {'runs changed':>13}"
        f" {'first div (med)':>16} {'max |dlogp| before div':>23} {'state rel err':>14}"
    )
    with tempfile.TemporaryDirectory() as root:
        for arch in cpu_archs(mixer="mamba2"):
            for errors in STATE_ERRORS.values():
                errors.clear()
            rows = run_arch(arch, root, args.prompts, args.prefix, args.tail, args.new_tokens)
            for name, res in rows.items():
                changed = statistics.mean(r[0] for r in res)
                runs = sum(r[0] > 0 for r in res)
                first = statistics.median(r[1] for r in res)
                dlp = max(r[2] for r in res)
                print(
                    f"{arch:>17} {name:>8} {changed:>14.1%} {runs:>6}/{len(res):<6}"
                    f" {first:>16.0f} {dlp:>23.4f} {max(STATE_ERRORS[name]):>14.2e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
