"""Explicit cache breakpoints, prewarm with pins, cache reports: a real `vllm-hybrid serve`.

One server per module (tiny Zamba2, 128-token blocks, prefix match unit 1, 2,048 pool blocks,
pins bounded to 0.7% of the pool = 14 pages, integrity checks after every scheduler step).
Oracles:

* a ``cache_control`` mark on the system message puts a breakpoint at exactly the rendered
  system message's token count (vLLM's own ``/tokenize``), and a second conversation with the
  same system prompt hits at exactly that position (inside a 128-token block: vLLM alone
  would keep the state at the block boundary below it);
* without the mark the same second conversation hits nothing (vLLM keeps no state there);
* after a prewarm, the very first real request hits exactly the pinned prefix;
* greedy outputs with breakpoints equal outputs computed from scratch (the same request under a
  fresh ``cache_salt`` shares no cached block);
* bad requests get HTTP 400 with a message, and the server keeps serving.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import httpx
import openai
import pytest

from vllm_hybrid.demo import free_port, start_server, stop_server, wait_ready
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine

BLOCK = 128
#: The server's prefix match unit (``--prefix-match-unit``): 1 makes every hit land where asked
#: (a breakpoint's state is kept at exactly its position; docs/serving.md).
UNIT = 1
PIN_FRACTION = 0.007  # of 2,048 blocks: 14 pages
WORDS = (
    "hammer saw drill screw nail bolt anchor paint brush roller tape hose seed soil pot pipe "
    "valve fitting ladder glue sandpaper chisel wrench pliers level clamp"
).split()


def text(seed: int, words: int) -> str:
    """Deterministic filler (a distinct text per seed)."""
    return " ".join(WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(words))


#: The ``modules`` setting's file: one path of two modules (~300 tokens), pins of 1 s.
START_MODULES = {
    "modules": {"intro": text(91, 50) + "\n", "policy": text(92, 50) + "\n"},
    "paths": [["intro", "policy"]],
    "ttl_s": 1,
}

#: Our server's model name, unique: a request never reaches another test session's server
#: that took the same free port between free_port() and our bind.
MODEL = f"tiny-bp-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server(model_root, tmp_path_factory):
    port, log = free_port(), tmp_path_factory.mktemp("server") / "server.log"
    modules = log.parent / "modules.json"  # registered and prewarmed at start
    modules.write_text(json.dumps(START_MODULES))
    settings = {
        "vllm_hybrid": {
            "max_pinned_fraction": PIN_FRACTION,
            "debug": True,
            "modules": str(modules),
        }
    }
    proc = start_server(
        tiny_model_dir("zamba2", model_root),
        port,
        log,
        "--additional-config",
        json.dumps(settings),
        "--served-model-name",
        MODEL,
        "--prefix-match-unit",
        str(UNIT),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, port, log)
        deadline = time.monotonic() + 600
        while MODEL not in httpx.get(f"{url}/v1/models", timeout=10).text:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)  # another process answered on our port: wait for ours (or its exit)
        yield url
    finally:
        stop_server(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none")


def chat(client, messages, **extra):
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0.0, extra_body=extra or None
    )
    hybrid = (reply.model_extra.get("kv_transfer_params") or {}).get("vllm_hybrid") or {}
    return reply.usage.prompt_tokens_details.cached_tokens, reply.choices[0].message.content, hybrid


def count_tokens(server, messages) -> int:
    answer = httpx.post(
        f"{server}/tokenize",
        json={"messages": messages, "add_generation_prompt": False},
        timeout=30,
    )
    answer.raise_for_status()
    return answer.json()["count"]


def system(seed: int, marked: bool, block_form: bool = False) -> dict:
    content = text(seed, 200)  # ~630 tokens: the breakpoint's state is at 512
    mark = {"type": "ephemeral"}
    if block_form:  # Anthropic style: the mark on a content block
        return {
            "role": "system",
            "content": [{"type": "text", "text": content, "cache_control": mark}],
        }
    return {"role": "system", "content": content, **({"cache_control": mark} if marked else {})}


def user(seed: int) -> dict:
    return {"role": "user", "content": text(seed + 100, 100)}  # ~315 tokens: past the next block


@pytest.mark.parametrize("block_form", [False, True], ids=["message", "content-block"])
def test_breakpoint_on_system_prompt_hits_exactly_there(client, server, block_form):
    seed = 11 + block_form
    sys_msg = system(seed, marked=True, block_form=block_form)
    expected = count_tokens(server, [{"role": "system", "content": text(seed, 200)}])
    cached, _, hybrid = chat(client, [sys_msg, user(1)], vllm_xargs={"cache_report": 1})
    report = hybrid["cache_report"]
    assert cached == 0
    assert report["breakpoints"] == [expected]
    assert report["breakpoint_hit_positions"] == [expected]
    # A second conversation, same system prompt (unmarked), another user turn.
    cached, _, hybrid = chat(client, [system(seed, False), user(2)], vllm_xargs={"cache_report": 1})
    assert expected % BLOCK and expected > BLOCK  # inside a block: no block boundary helps
    assert cached == expected  # exactly the breakpoint
    assert hybrid["cache_report"]["hit_tokens"] == cached
    assert hybrid["cache_report"]["ended_on_snapshot"] is True


def test_anthropic_messages_breakpoint_on_a_system_block(server):
    """vLLM's ``/v1/messages``: a mark on a system block; the hit: ``cache_read_input_tokens``."""
    seed = 13
    expected = count_tokens(server, [{"role": "system", "content": text(seed, 200)}])

    def ask(marked, turn):
        block = {"type": "text", "text": text(seed, 200)}
        if marked:
            block["cache_control"] = {"type": "ephemeral"}
        body = {
            "model": MODEL,
            "max_tokens": 4,
            "system": [block],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": user(turn)["content"]}]}
            ],
            "vllm_xargs": {"cache_report": 1},
        }
        answer = httpx.post(f"{server}/v1/messages", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"].get("cache_read_input_tokens") or 0

    assert ask(True, 1) == 0
    assert ask(False, 2) == expected > 0


def complete(client, prompt, **extra):
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0, extra_body=extra or None
    )
    hybrid = (reply.model_extra.get("kv_transfer_params") or {}).get("vllm_hybrid") or {}
    details = reply.usage.prompt_tokens_details
    return reply.usage.prompt_tokens, details.cached_tokens, reply.choices[0].text, hybrid


def test_modules_file_is_registered_and_prewarmed_at_start(client, server):
    listed = httpx.get(f"{server}/v1/hybrid/modules", timeout=30).json()
    assert listed["paths"] == [["intro", "policy"]]
    end = listed["lead_tokens"] + sum(m["tokens"] for m in listed["modules"].values())
    (prewarmed,) = listed["prewarmed"]
    assert prewarmed["boundaries"][-1] == end and end % BLOCK
    assert prewarmed["pinned"] and prewarmed["pinned_tokens"] == end > 0
    _, cached, _, _ = complete(
        client, "Where is the glue?", vllm_xargs={"modules": ["intro", "policy"]}
    )
    assert cached == end


def test_prompt_modules_hit_at_the_second_module_boundary_on_first_appearance(client, server):
    """Issue 6 acceptance: modules (system, doc_a, doc_b) on the path
    [system, {union: [doc_a, doc_b]}], registered over HTTP; the first request ever importing
    [system, doc_b] hits at exactly doc_b's end. Placed before the prewarm tests: its pins
    (2 s) must expire before those need the 14-page pin budget."""
    schema = {
        "modules": {
            "system": text(81, 57) + "\n",  # ~180 tokens each: system ends in block 1,
            "doc_a": text(82, 57) + "\n",  # doc_a / doc_b in block 2
            "doc_b": text(83, 57) + "\n",
        },
        "paths": [["system", {"union": ["doc_a", "doc_b"]}]],
        "ttl_s": 2,
    }
    answer = httpx.post(f"{server}/v1/hybrid/modules", json=schema, timeout=300)
    assert answer.status_code == 200, answer.text
    registered = answer.json()
    n = {name: m["tokens"] for name, m in registered["modules"].items()}
    lead = registered["lead_tokens"]
    sys_end = lead + n["system"]
    ends = {doc: sys_end + n[doc] for doc in ("doc_a", "doc_b")}
    assert (
        n["system"]
        == httpx.post(
            f"{server}/tokenize", json={"prompt": schema["modules"]["system"]}, timeout=30
        ).json()["count"]
        - lead
    )
    # Module ends inside blocks: no block boundary helps (prefix match unit 1: hits are exact).
    assert BLOCK < sys_end < 2 * BLOCK < ends["doc_b"] and ends["doc_b"] % BLOCK and sys_end % BLOCK
    prewarmed = {tuple(p["path"]): p for p in registered["prewarmed"]}
    assert list(prewarmed) == [("system", "doc_a"), ("system", "doc_b")]
    for doc, cached_before in (("doc_a", 0), ("doc_b", sys_end)):
        p = prewarmed[("system", doc)]
        assert p["boundaries"] == [sys_end, ends[doc]] and p["prompt_tokens"] == ends[doc]
        assert p["pinned"] and p["pinned_tokens"] == ends[doc]
        # doc_b's prewarm resumed from the state doc_a's prewarm kept at system's boundary.
        assert p["cached_tokens"] == cached_before
    listed = httpx.get(f"{server}/v1/hybrid/modules", timeout=30).json()
    assert listed["paths"] == [["system", "doc_a"], ["system", "doc_b"]]

    question = "Which aisle has the drills and the sandpaper?"
    imports = {"modules": ["system", "doc_b"], "cache_report": 1}
    prompt_tokens, cached, reply, hybrid = complete(client, question, vllm_xargs=imports)
    assert prompt_tokens > ends["doc_b"]
    assert cached == ends["doc_b"]  # the prewarm's state, past system's boundary
    assert hybrid["cache_report"]["breakpoints"] == [sys_end, ends["doc_b"]]
    # The same prompt from scratch: a fresh cache_salt shares no block.
    _, fresh_cached, fresh, _ = complete(
        client, question, vllm_xargs={"modules": ["system", "doc_b"]}, cache_salt=uuid.uuid4().hex
    )
    assert (fresh_cached, fresh) == (0, reply)

    # Bad schemas and imports: 400 with a message; the registration stands, the server serves.
    bad = {"modules": {"system": "x"}, "paths": [["system", "nope"]]}
    answer = httpx.post(f"{server}/v1/hybrid/modules", json=bad, timeout=60)
    assert answer.status_code == 400
    assert "paths[0][1]: unknown module 'nope'" in answer.json()["error"]["message"]
    for body, message in (
        ({"prompt": "q", "vllm_xargs": {"modules": ["doc_c"]}}, "unknown module 'doc_c'"),
        ({"prompt": ["a", "b"], "vllm_xargs": {"modules": ["system"]}}, "one prompt"),
    ):
        answer = httpx.post(
            f"{server}/v1/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60
        )
        assert answer.status_code == 400 and message in answer.json()["error"]["message"]
    answer = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": MODEL, "messages": [user(1)], "vllm_xargs": {"modules": ["system"]}},
        timeout=60,
    )
    assert answer.status_code == 400 and "/v1/completions only" in answer.text
    assert httpx.get(f"{server}/v1/hybrid/modules", timeout=30).json()["paths"] == listed["paths"]
    # The same prompt again: its last chunk started in its last block, so with
    # exact_prompt_end off (the default) no state was kept at P - 1 and the repeat resumes at
    # doc_b's end again (with it on: P - 1; docs/results/2026-12-06-one-token-tail.md).
    assert complete(client, question, vllm_xargs=imports)[1] == ends["doc_b"] < prompt_tokens - 1


def test_sub_block_breakpoints_hit_exactly_and_outputs_match_from_scratch(client):
    """Token-id prompts with ``cache_breakpoints``: a stop in the prompt tail's block, two stops
    in one block, and one whose block the first request then fills by decoding. A later prompt
    sharing exactly the first ``B`` tokens hits ``B``, and its greedy reply equals the same
    request under a fresh ``cache_salt`` (computed from scratch)."""
    import random

    rng = random.Random(17)
    draw = lambda n: [rng.randrange(10, 1000) for _ in range(n)]  # noqa: E731

    def run(prompt, max_tokens=4, check=True, **xargs):
        extra = {"vllm_xargs": xargs} if xargs else {}
        reply = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0, extra_body=extra
        )
        if not check:
            return reply.usage.prompt_tokens_details.cached_tokens
        fresh = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"cache_salt": uuid.uuid4().hex},
        )
        assert reply.choices[0].text == fresh.choices[0].text
        return reply.usage.prompt_tokens_details.cached_tokens

    a, b, d = draw(300), draw(300), draw(250)
    cases = [
        (a, [280], 4, [a[:280]]),  # in the block of the prompt's tail (299)
        (b, [150, 170], 4, [b[:150], b[:170]]),  # two in one block
        (d, [245], 12, [d[:245]]),  # decoding then fills the stop's block (to 262)
    ]
    got, want = [], []
    for first, stops, max_tokens, sharing in cases:
        assert run(first, max_tokens, check=False, cache_breakpoints=stops) == 0
        for prefix, stop in zip(sharing, stops, strict=True):
            got.append(run(prefix + draw(40)))
            want.append(stop)
    assert got == want


def test_next_turn_resumes_at_exactly_the_end_of_the_answer(client):
    """No breakpoint needed for a conversation: with ``U = 1`` the state at the end of an
    answer (prompt + output - 1, the last computed position) is kept exactly
    (``output_states.OutputStates``), here inside the block that also holds a breakpoint stop
    and the prompt's tail. The next turn (prompt + answer + new tokens) hits there, the
    breakpoint still hits, and a next turn that shares the prompt and only part of the answer
    (a chat template that re-renders it differently) resumes at the prompt's own end (300,
    ``core.prompt_end_stop``; without it at the breakpoint's 280 below). The replies equal the
    same requests from scratch."""
    import random

    rng = random.Random(23)
    draw = lambda n: [rng.randrange(10, 1000) for _ in range(n)]  # noqa: E731
    prompt = draw(300)
    reply = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0.0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "vllm_xargs": {"cache_breakpoints": 280}},
    )
    answer = [int(t.split(":")[1]) for t in reply.choices[0].logprobs.tokens]
    assert len(answer) == 8
    turns = (
        (prompt + answer + draw(20), 300 + 8 - 1),
        (prompt[:280] + draw(20), 280),
        (prompt + answer[:3] + draw(20), 300),
    )
    for turn, hit in turns:
        got = client.completions.create(model=MODEL, prompt=turn, max_tokens=4, temperature=0.0)
        fresh = client.completions.create(
            model=MODEL,
            prompt=turn,
            max_tokens=4,
            temperature=0.0,
            extra_body={"cache_salt": uuid.uuid4().hex},
        )
        assert got.usage.prompt_tokens_details.cached_tokens == hit
        assert got.choices[0].text == fresh.choices[0].text


def test_without_a_mark_the_server_marks_where_the_system_prompt_ends(client, server):
    """No cache_control: the server's own breakpoint after the system prompt and the next
    message's role header (system_breakpoint, on by default). vLLM alone: 0 on the second
    conversation (no state where the two diverge)."""
    cached, _, _ = chat(client, [system(21, False), user(1)])
    cached_again, _, _ = chat(client, [system(21, False), user(2)])
    system_tokens = count_tokens(server, [system(21, False)])
    header = count_tokens(server, [system(21, False), {"role": "user", "content": ""}])
    assert cached == 0
    # at the end of the system prompt, plus the part of the user header the two share
    assert system_tokens < cached_again < header


def test_outputs_with_breakpoints_equal_uncached(client, server):
    """Each reply under a fresh cache_salt is computed from scratch (no shared block)."""
    seed, replies = 31, []
    expected = count_tokens(server, [system(seed, False)])
    for turn in range(2):
        sys_msg = system(seed, marked=turn == 0)
        cached, reply, _ = chat(client, [sys_msg, user(turn)])
        _, fresh, _ = chat(client, [system(seed, False), user(turn)], cache_salt=uuid.uuid4().hex)
        replies.append((cached, reply, fresh))
    assert [c for c, _, _ in replies] == [0, expected]
    assert all(reply == fresh for _, reply, fresh in replies)


def wait_until_unpinned(client, server, timeout_s: float = 60.0) -> None:
    """Earlier tests' short pins (modules: TTL 1-2 s) are released at the first scheduler step
    after their TTL; step the engine until none is left, so the pin budget starts empty."""
    deadline = time.monotonic() + timeout_s
    while scrape(server).get("vllm_hybrid:pins", 0.0) > 0:
        assert time.monotonic() < deadline, "earlier pins were never released"
        time.sleep(0.5)
        chat(client, [user(7)])


def test_prewarm_then_first_request_hits(client, server):
    wait_until_unpinned(client, server)
    messages = [system(41, False)]
    answer = httpx.post(
        f"{server}/v1/hybrid/prewarm", json={"messages": messages, "ttl_s": 60}, timeout=120
    )
    assert answer.status_code == 200, answer.text
    pin = answer.json()
    assert pin["pinned_tokens"] == pin["prompt_tokens"] == count_tokens(server, messages)
    # KV blocks (the last one partly filled) + 3 Mamba groups' states.
    assert pin["pinned_pages"] == -(-pin["pinned_tokens"] // BLOCK) + 3
    cached, _, _ = chat(client, [*messages, user(5)])
    assert cached == pin["pinned_tokens"] > 0
    again = httpx.post(
        f"{server}/v1/hybrid/prewarm", json={"messages": messages, "ttl_s": 90}, timeout=120
    ).json()
    assert again["extended"] is True and again["pool_pinned_pages"] == pin["pool_pinned_pages"]
    metrics = scrape(server)
    assert metrics["vllm_hybrid:pins"] >= 1
    assert metrics["vllm_hybrid:pinned_pages"] >= pin["pinned_pages"]
    assert metrics["vllm_hybrid:pin_limit_pages"] == int(2048 * PIN_FRACTION)
    assert 0 < metrics["vllm_hybrid:pin_ttl_left_seconds_max"] <= 90


def test_pin_expires_after_its_ttl(client, server):
    answer = httpx.post(
        f"{server}/v1/hybrid/prewarm", json={"prompt": text(51, 100), "ttl_s": 1}, timeout=120
    )
    assert answer.status_code == 200, answer.text
    expired = scrape(server).get("vllm_hybrid:pins_expired_total", 0.0)
    time.sleep(1.5)
    chat(client, [user(6)])  # pins expire at the next scheduler step
    assert scrape(server)["vllm_hybrid:pins_expired_total"] >= expired + 1


def test_pin_over_the_limit_is_a_400_and_the_server_keeps_serving(client, server):
    # ~1,640 tokens: 12 KV pages + 3 state pages > the 14-page limit.
    answer = httpx.post(
        f"{server}/v1/hybrid/prewarm", json={"prompt": text(61, 520), "ttl_s": 30}, timeout=300
    )
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert "refused" in message and "max_pinned_fraction" in message
    assert chat(client, [user(7)])[1]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("chat", {"vllm_xargs": {"cache_breakpoints": "end"}}, "not a token position"),
        ("chat", {"vllm_xargs": {"cache_breakpoints": [0]}}, "must be at least 1"),
        ("chat", {"vllm_xargs": {"cache_breakpiont": 5}}, "unknown cache option"),
        ("chat", {"vllm_xargs": {"cache_pin_ttl_s": 10**6}}, "max_pin_ttl_s"),
        ("chat", {"mark": {"type": "persistent"}}, "type 'persistent' is not supported"),
        ("chat", {"mark": "yes"}, "cache_control must be an object"),
        ("completions", {"vllm_xargs": {"cache_report": "maybe"}}, "must be true or false"),
        ("prewarm", {"ttl_s": 10}, "exactly one of"),
        ("prewarm", {"prompt": "x", "ttl_s": -1}, "positive number"),
        ("prewarm", {"prompt": "x", "ttl_s": 10**6}, "max_pin_ttl_s"),
        ("prewarm", {"prompt": "x", "ttl": 5}, "unknown field"),
        ("prewarm", "not json", "JSON object"),
    ],
)
def test_bad_requests_are_400_with_a_message(server, path, body, message):
    url = {
        "chat": f"{server}/v1/chat/completions",
        "completions": f"{server}/v1/completions",
        "prewarm": f"{server}/v1/hybrid/prewarm",
    }[path]
    if path == "chat":
        mark = body.pop("mark", None)
        sys_msg = {"role": "system", "content": "be brief"}
        if mark is not None:
            sys_msg["cache_control"] = mark
        body = {"model": MODEL, "max_tokens": 2, "messages": [sys_msg, user(8)], **body}
    elif path == "completions":
        body = {"model": MODEL, "max_tokens": 2, "prompt": "hello", **body}
    payload = {"content": body} if isinstance(body, str) else {"json": body}
    answer = httpx.post(url, timeout=60, **payload)
    assert answer.status_code == 400, answer.text
    assert message in answer.json()["error"]["message"]


def test_marks_with_an_unknown_model_get_vllms_own_404(client, server):
    with pytest.raises(openai.NotFoundError):
        chat_body = [system(71, marked=True), user(1)]
        client.chat.completions.create(model="no-such-model", messages=chat_body, max_tokens=2)
    answer = httpx.post(
        f"{server}/v1/hybrid/prewarm",
        json={"model": "no-such-model", "messages": [system(71, False)]},
        timeout=60,
    )
    assert answer.status_code == 404, answer.text


def test_server_keeps_serving_after_bad_requests(client):
    cached, reply, _ = chat(client, [user(9)])
    assert reply


def scrape(server) -> dict[str, float]:
    with urllib.request.urlopen(f"{server}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    out: dict[str, float] = {}
    for line in lines:
        if line.startswith("vllm_hybrid:") and "{" in line:
            name = line.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
    return out


def test_offline_llm_breakpoints_prewarm_and_oracle(model_root):
    """``LLM(...)`` on a 48-block pool: breakpoints in ``SamplingParams.extra_args``;
    ``prewarm(llm, ...)`` pins a prefix that survives a churn evicting an unpinned twin; a pin
    over the limit refused; greedy outputs == an engine with prefix caching off."""
    import random

    from tests.engine.conftest import engine, vllm
    from vllm_hybrid.adapters.vllm.prewarm import PinRefusedError, prewarm

    rng = random.Random(7)
    draw = lambda n: [rng.randrange(10, 1000) for _ in range(n)]  # noqa: E731
    prefix = draw(600)
    prompts = [prefix + draw(300) for _ in range(3)]
    warm, twin = draw(700), draw(700)
    prompts += [warm + draw(50), twin + draw(50)]
    churn = [draw(900) for _ in range(6)]  # ~60 blocks through a 48-block pool

    def run(llm, prompt, **extra):
        params = vllm.SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True, extra_args=extra or None
        )
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return out.num_cached_tokens, list(out.outputs[0].token_ids)

    # 8 of 48 pages: the 700-token prewarm (5 KV + 3 state pages) fits exactly, nothing more.
    # U = the block (vLLM's default; ours is 1): the block-floored hits below
    settings = {"vllm_hybrid": {"max_pinned_fraction": 0.17, "debug": True, "match_unit": "block"}}
    pool = {"num_gpu_blocks_override": 48, "max_model_len": 2048}
    model_dir = tiny_model_dir("zamba2", model_root)
    with engine(model_dir, enable_prefix_caching=True, additional_config=settings, **pool) as llm:
        got = [run(llm, prompts[0], cache_breakpoints=[600])]
        got += [run(llm, p) for p in prompts[1:3]]
        pin = prewarm(llm, warm, ttl_s=600)
        with pytest.raises(PinRefusedError, match="refused"):
            prewarm(llm, twin, ttl_s=60)  # computed and cached, but not pinned
        for prompt in churn:
            run(llm, prompt)
        got += [run(llm, p) for p in prompts[3:]]
        bad = vllm.SamplingParams(max_tokens=2, extra_args={"cache_breakpoints": "end"})
        (out,) = llm.generate([{"prompt_token_ids": draw(40)}], bad, use_tqdm=False)
        assert "not a token position" in out.kv_transfer_params["vllm_hybrid"]["error"]
        assert out.outputs[0].token_ids  # served: the engine ignores bad options, never dies
    with engine(model_dir, enable_prefix_caching=False, **pool) as llm:
        want = [run(llm, p) for p in prompts]
    assert (pin["tokens"], pin["pages"]) == (640, 640 // BLOCK + 3)
    # 600 -> 512; the pinned prefix survives the churn (640), its unpinned twin does not.
    assert [c for c, _ in got] == [0, 512, 512, 640, 0]
    assert [t for _, t in got] == [t for _, t in want]


def test_breakpoints_prewarm_example(server):
    from tests.engine.test_examples import load_example

    got = load_example("breakpoints_prewarm").main(server, MODEL)
    assert got["first_after_prewarm"] == got["pinned_tokens"] > 0
    assert got["second_conversation"] == got["breakpoint"] > 0
    assert got["report"]["reason"] == "no_snapshot"  # KV to 512, the state at the breakpoint
    assert got["report"]["diverges_at_token"] > got["breakpoint"]


def test_startup_calls_carry_the_servers_api_key(monkeypatch):
    """The ``modules`` file is registered at start through vLLM's routes, below vLLM's
    ``AuthenticationMiddleware`` when ``--api-key`` is set: the calls carry the first key."""
    from types import SimpleNamespace

    from vllm_hybrid.serving.asgi import internal_scope

    def app(api_key):
        return SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(api_key=api_key)))

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    scope = internal_scope({"type": "lifespan", "app": app(["k1", "k2"])})
    assert scope["type"] == "http" and (b"authorization", b"Bearer k1") in scope["headers"]
    assert internal_scope({"type": "lifespan", "app": app(None)})["headers"] == []
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    scope = internal_scope({"type": "lifespan", "app": app(None)})
    assert scope["headers"] == [(b"authorization", b"Bearer env-key")]
