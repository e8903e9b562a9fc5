"""Train/inference numerics of the reference MoE model: stock ops vs `batch_invariant()`.

Prints, side by side in one run:
1. log-prob mismatch and routing agreement between batched decoding (the inference
   engine: sequences start at different times, KV cache, one token per step) and
   single-sequence scoring (the trainer), with stock torch ops and with batch_invariant();
2. the overhead of batch_invariant() over stock ops for a training step (forward with
   router replay, backward, optimizer step) and for batched decoding.

With --gpu (run by scripts/gpu_check.sh on a CUDA machine) it instead checks the compiled
Triton kernels: bitwise batch invariance for batch sizes 1..64 in fp32 and bf16, and their
time against torch's stock CUDA ops (cuBLAS, fused norms, SDPA), plus the model table on GPU.

Usage: uv run python benchmarks/determinism.py [--quick] [--threads N] [--gpu]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable

import torch

from tandem.moe_determinism import (
    MoEConfig,
    MoETransformer,
    RouterReplay,
    RoutingTrace,
    batch_invariant,
    compare_logprobs,
    routing_agreement,
    target_logprobs,
)

CONFIG = MoEConfig(
    vocab_size=8192,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    moe_intermediate_size=256,
    num_experts=16,
    num_experts_per_tok=4,
    kv_split_size=64,
)


def generate(model: MoETransformer, prompts: list[torch.Tensor], new_tokens: int, seed: int):
    """Batched sampling with a KV cache; sequence i joins at step 2*i (staggered starts)."""
    n = len(prompts)
    cache = model.new_cache(max_slots=n, max_len=max(len(p) for p in prompts) + new_tokens + 1)
    gen = torch.Generator().manual_seed(seed)
    tokens = [p.tolist() for p in prompts]
    logps: list[list[float]] = [[] for _ in range(n)]
    traces: list[list[RoutingTrace]] = [[] for _ in range(n)]
    produced = [0] * n
    pending: list[torch.Tensor | None] = [None] * n  # logits for the next token of each seq
    step = 0
    while any(c < new_tokens for c in produced):
        joining = [i for i in range(n) if step == 2 * i]
        active = [i for i in range(n) if pending[i] is not None and produced[i] < new_tokens]
        # Sample from pending logits, then feed the sampled tokens (and new prompts) together.
        feeds: list[tuple[int, list[int]]] = []
        for i in active:
            lp = torch.log_softmax(pending[i].float(), -1)
            tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
            logps[i].append(float(lp[tok]))
            tokens[i].append(tok)
            produced[i] += 1
            if produced[i] < new_tokens:
                feeds.append((i, [tok]))
            else:
                pending[i] = None
        feeds += [(i, tokens[i]) for i in joining]
        if feeds:
            width = max(len(f) for _, f in feeds)
            ids = torch.zeros(len(feeds), width, dtype=torch.long)
            for j, (_, f) in enumerate(feeds):
                ids[j, : len(f)] = torch.tensor(f)
            out = model(
                ids, lengths=[len(f) for _, f in feeds], cache=cache, slots=[i for i, _ in feeds]
            )
            for j, ((i, f), tr) in enumerate(zip(feeds, out.traces(), strict=True)):
                pending[i] = out.logits[j, len(f) - 1]
                traces[i].append(tr)
        step += 1
    # The last sampled token of each sequence was never fed: its route is not part of the trace.
    return tokens, logps, [RoutingTrace.concat(t) for t in traces]


def mismatch(model: MoETransformer, prompts, new_tokens: int, invariant: bool):
    with torch.no_grad(), batch_invariant(invariant):
        tokens, engine_lp, engine_tr = generate(model, prompts, new_tokens, seed=0)
        a, b, ta, tb = [], [], [], []
        for i, seq in enumerate(tokens):
            ids = torch.tensor(seq)
            out = model(ids[None, :-1])  # the trainer scores the sequence alone
            lp = target_logprobs(out.logits[0], ids[1:])[len(prompts[i]) - 1 :]
            a.append(lp)
            b.append(torch.tensor(engine_lp[i], dtype=torch.float32))
            ta.append(out.traces()[0])
            tb.append(engine_tr[i])
    lp = compare_logprobs(torch.cat(a), torch.cat(b))
    ra = routing_agreement(RoutingTrace.concat(ta), RoutingTrace.concat(tb))
    return lp, ra


def _interleaved_best(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Best time of each run, the runs alternating (stock, invariant, stock, ...) after one
    warm-up each, so that a change in machine load hits both sides alike."""
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, run in runs.items():
            best[name] = min(best[name], run())
    return best


def train_step(model: MoETransformer, batch: torch.Tensor, invariant: bool) -> Callable[[], float]:
    """A timed training step: forward with router replay, backward, optimizer step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    with torch.no_grad(), batch_invariant(invariant):
        traces = model(batch).traces()

    def step() -> float:
        t0 = time.perf_counter()
        with batch_invariant(invariant):
            out = model(batch, routing=RouterReplay(traces, "R3"))
            loss = -target_logprobs(out.logits[:, :-1], batch[:, 1:]).mean()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return step


def decode(
    model: MoETransformer, batch: int, prompt: int, steps: int, invariant: bool
) -> Callable[[], float]:
    """Timed batched decoding: `steps` one-token steps after a prefill (not timed)."""
    ids = torch.randint(
        0, CONFIG.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1)
    )

    def run() -> float:
        with torch.no_grad(), batch_invariant(invariant):
            cache = model.new_cache(batch, prompt + steps)
            out = model(ids, cache=cache, slots=list(range(batch)))
            nxt = out.logits[:, -1].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(nxt[:, None], cache=cache, slots=list(range(batch)))
                nxt = out.logits[:, -1].argmax(-1)
            return time.perf_counter() - t0

    return run


def _cuda_time(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / 1e3


def _row(name: str, dtype: torch.dtype, ok: object, stock_s: float, ours_s: float) -> None:
    dt = str(dtype).removeprefix("torch.")
    print(
        f"{name:34}{dt:>10}{ok!s:>11}{stock_s * 1e3:>10.3f}{ours_s * 1e3:>11.3f}{ours_s / stock_s:>7.2f}x"
    )


def _gpu_dtype_checks(dtype: torch.dtype) -> int:
    import torch.nn.functional as F

    from tandem.moe_determinism import ops

    dev = "cuda"
    failures = 0
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(64, 4096, device=dev, generator=gen).to(dtype)
    w = torch.randn(4096, 4096, device=dev, generator=gen).to(dtype)
    big = torch.randn(8192, 4096, device=dev, generator=gen).to(dtype)
    x = torch.randn(64, 151936, device=dev, generator=gen).to(dtype)
    h = torch.randn(4096, 4096, device=dev, generator=gen).to(dtype)
    cases = {
        "matmul [m,4096]x[4096,4096]": (
            a,
            lambda t: ops.linear(t, w),
            lambda: F.linear(big, w),
            lambda: ops.linear(big, w),
        ),
        "log_softmax [m,151936]": (
            x,
            lambda t: ops.log_softmax(t, -1),
            lambda: torch.log_softmax(x, -1),
            lambda: ops.log_softmax(x, -1),
        ),
        "rms_norm [m,4096]": (
            h[:64],
            lambda t: ops.rms_norm(t, None),
            lambda: F.rms_norm(h, (4096,)),
            lambda: ops.rms_norm(h, None),
        ),
    }
    for name, (inp, fn, stock, ours) in cases.items():
        full = fn(inp)
        ok = all(torch.equal(fn(inp[:m]), full[:m]) for m in range(1, inp.shape[0] + 1))
        failures += not ok
        _row(name, dtype, ok, _cuda_time(stock), _cuda_time(ours))

    q = torch.randn(8, 32, 1024, 128, device=dev, generator=gen).to(dtype)
    k = torch.randn(8, 4, 1024, 128, device=dev, generator=gen).to(dtype)
    v = torch.randn(8, 4, 1024, 128, device=dev, generator=gen).to(dtype)
    full = ops.attention(q, k, v, kv_split_size=64)

    def decode_ok(p: int) -> bool:
        one = ops.attention(
            q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], kv_split_size=64
        )
        alone = ops.attention(
            q[:1, :, p : p + 1], k[:1, :, : p + 1], v[:1, :, : p + 1], kv_split_size=64
        )
        return torch.equal(one[:, :, 0], full[:, :, p]) and torch.equal(
            alone[:, :, 0], full[:1, :, p]
        )

    ok = all(decode_ok(p) for p in (0, 1, 63, 64, 65, 500, 1023))
    failures += not ok
    ts = _cuda_time(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )
    to = _cuda_time(lambda: ops.attention(q, k, v, kv_split_size=64))
    _row("attention prefill 8x32x1024x128", dtype, ok, ts, to)
    qd = q[:, :, -1:]
    ts = _cuda_time(lambda: F.scaled_dot_product_attention(qd, k, v, enable_gqa=True))
    to = _cuda_time(lambda: ops.attention(qd, k, v, kv_split_size=64))
    _row("attention decode 8x32x1x1024", dtype, "", ts, to)
    ref = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True
    )
    err = (full.float() - ref).abs().max().item()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    if err > tol:
        failures += 1
        print(f"attention differs from SDPA by {err:.2e} (> {tol})")
    return failures


def gpu_checks() -> int:
    """Compiled Triton kernels: invariance (bitwise, m = 1..64) and speed vs stock CUDA ops."""
    if not torch.cuda.is_available():
        print("--gpu: no CUDA device visible to torch")
        return 1
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(
        f"{'kernel':34}{'dtype':>10}{'invariant':>11}{'stock ms':>10}{'triton ms':>11}{'ratio':>8}"
    )
    failures = sum(_gpu_dtype_checks(dtype) for dtype in (torch.float32, torch.bfloat16))
    print(f"\nGPU kernel checks: {'all passed' if not failures else f'{failures} FAILED'}")
    return 1 if failures else 0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smaller workload (smoke run)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--gpu", action="store_true", help="check the compiled Triton kernels on CUDA")
    args = ap.parse_args()
    if args.gpu:
        raise SystemExit(gpu_checks())
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = MoETransformer(CONFIG)
    model.reset_parameters(seed=0)
    model.eval()
    n_seq, new_tokens, repeats = (4, 12, 1) if args.quick else (8, 32, 3)
    gen = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(0, CONFIG.vocab_size, (int(length),), generator=gen)
        for length in torch.randint(8, 48, (n_seq,), generator=gen)
    ]
    print(
        f"model: {CONFIG.num_hidden_layers} layers, hidden {CONFIG.hidden_size}, {CONFIG.num_experts} experts "
        f"top-{CONFIG.num_experts_per_tok}, vocab {CONFIG.vocab_size}; torch threads {torch.get_num_threads()}"
    )
    print(
        f"workload: {n_seq} sequences, staggered starts, {new_tokens} sampled tokens each (fp32, CPU)\n"
    )

    rows = {}
    for label, inv in (("stock ops", False), ("batch_invariant()", True)):
        rows[label] = mismatch(model, prompts, new_tokens, inv)
    print("1) batched decoding (engine) vs single-sequence scoring (trainer)")
    print(f"{'':28}{'stock ops':>18}{'batch_invariant()':>20}")
    s, b = rows["stock ops"], rows["batch_invariant()"]
    for name, fmt, get in (
        ("max |dlogprob|", "{:.3e}", lambda r: r[0].max_abs_diff),
        ("mean |dlogprob|", "{:.3e}", lambda r: r[0].mean_abs_diff),
        ("KL k1", "{:.3e}", lambda r: r[0].kl_k1),
        ("KL k3", "{:.3e}", lambda r: r[0].kl_k3),
        ("tokens with dlogprob != 0", "{:.2%}", lambda r: r[0].frac_tokens_differ),
        ("routing agreement/decision", "{:.4%}", lambda r: r[1].per_decision),
        ("routing agreement/token", "{:.4%}", lambda r: r[1].per_token),
    ):
        print(f"{name:28}{fmt.format(get(s)):>18}{fmt.format(get(b)):>20}")

    print("\n2) overhead of batch_invariant() over stock ops (best of repeats, runs alternating)")
    model.train()
    batch = torch.randint(0, CONFIG.vocab_size, (4, 128) if args.quick else (8, 256), generator=gen)
    train = _interleaved_best(
        {"stock": train_step(model, batch, False), "inv": train_step(model, batch, True)}, repeats
    )
    t_stock, t_inv = train["stock"], train["inv"]
    model.eval()
    dec_b, dec_p, dec_s = (4, 32, 8) if args.quick else (16, 128, 32)
    dec = _interleaved_best(
        {
            "stock": decode(model, dec_b, dec_p, dec_s, False),
            "inv": decode(model, dec_b, dec_p, dec_s, True),
        },
        repeats,
    )
    d_stock, d_inv = dec["stock"], dec["inv"]
    print(f"{'':40}{'stock':>10}{'invariant':>12}{'ratio':>8}{'target':>8}")
    print(
        f"{f'training step ({tuple(batch.shape)} tokens, replay)':40}{t_stock:>9.3f}s{t_inv:>11.3f}s{t_inv / t_stock:>7.2f}x{'<=1.5x':>8}"
    )
    print(
        f"{f'batched decode ({dec_b} seqs x {dec_s} steps)':40}{d_stock:>9.3f}s{d_inv:>11.3f}s{d_inv / d_stock:>7.2f}x{'<=2.0x':>8}"
    )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
