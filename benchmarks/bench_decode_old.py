"""Worker for bench_decode.py's ``old-*`` rows: another qkmla's decode step, timed on request.

Two versions of one package cannot be imported into one process, so bench_decode.py starts
this script as a child process with ``PYTHONPATH=<old checkout>/src`` (the old package then
shadows the installed one) and drives it round by round over a pipe: the old step is timed
between the new variants' calls, in the same rounds, so drift hits old and new alike. The
main process only waits on the pipe while the worker times.

Protocol: one JSON object per line on stdin, one JSON answer per line on stdout (everything
else the worker prints goes to stderr):

    {"cmd": "setup", "preset": P, "context": S, "dtype": "float32", "device": "cpu", "batch": B,
     "prefix": "old", "modes": ["eager"], "backend": "inductor"}
        -> {"qkmla": <path of the imported package>, "variants": [...], "torch_threads": N,
            "compile_errors": {mode: message}}
    {"cmd": "warm", "name": V}            -> {"seconds": one call after an untimed one}
    {"cmd": "round", "name": V, "n": N}   -> {"samples": [N timings, after one untimed call]}
    {"cmd": "quit"}

The variants are ``<prefix>-absorbed-mla`` and ``<prefix>-absorbed-mla-qknorm``: ``MLA.forward``
on one new token over a latent cache of S random rows, set up as bench_decode.py set it up at
the old commit (plain MLA shares the QK-normed layer's weights and latent rows). The code
below only uses what both the old and the new cache API have, or tries each.

bench_decode.py also starts a second worker on the current tree (prefix ``worker``), so that
the new code is timed in the same harness as the old: a process holding only these two
layers, not the main process's many variants and caches. Its ``modes`` may add
``compiled`` and ``compiled-optimized`` (suffixes as bench_decode.py's), which a package
without ``qkmla.attention.decode`` refuses.
"""

from __future__ import annotations

import json
import sys
import time

import torch

VARIANTS = ("old-absorbed-mla", "old-absorbed-mla-qknorm")


def fill(cache, context: int, rows: dict) -> None:
    slot = cache.plan(cache.batch_size, context)
    if hasattr(cache, "write_rows"):
        cache.write_rows(slot, rows)
    else:  # the old API: append(slot, **fields)
        cache.append(slot, **rows)


def keeper(cache):
    """A function that puts the cache's lengths back where they are now."""
    if hasattr(cache, "bookkeeping"):
        saved = cache.bookkeeping()
        return lambda: cache.restore(saved)
    lengths, max_len, uniform = cache.seqlens, cache.max_len, cache.uniform

    def restore():
        cache.seqlens, cache.max_len, cache.uniform = lengths, max_len, uniform
    return restore


def setup(preset: str, context: int, dtype: str, device: str, batch: int, prefix: str = "old",
          modes=("eager",), backend: str = "inductor", errors: dict | None = None) -> dict:
    """The variants' step functions by name; a compiled mode that fails to compile is left out
    and its error put in ``errors`` (by mode)."""
    errors = {} if errors is None else errors
    from qkmla import MLA, LatentCache, mla_preset

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    cfg = mla_preset(preset)
    qk = MLA(cfg).to(device=device, dtype=dt).eval()
    plain = MLA(cfg.replace(qk_norm=None)).to(device=device, dtype=dt).eval()
    plain.load_state_dict(qk.state_dict(), strict=False, assign=True)
    d_c, d_r, G = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_kv_groups
    kw = {"dtype": dt, "device": device}
    qk_cache = LatentCache.from_config(cfg, batch, context + 1, **kw)
    plain_cache = LatentCache.from_config(plain.config, batch, context + 1, **kw)
    latent = torch.randn(batch, context, d_c + d_r, **kw)
    scalar = [name for name in qk_cache.fields if name != "latent"]  # inv_rms (old) or key_scale (new)
    fill(qk_cache, context, {"latent": latent, scalar[0]: torch.rand(batch, context, G, **kw) + 0.5})
    fill(plain_cache, context, {"latent": latent})
    plain_cache.fields["latent"].data = qk_cache.fields["latent"].data
    x = torch.randn(batch, 1, cfg.hidden_size, **kw)

    def step(module, cache):
        restore = keeper(cache)

        def run():
            module(x, cache, path="absorbed")
            restore()
        return run

    fns = {}
    if "eager" in modes:
        fns.update({f"{prefix}-absorbed-mla": step(plain, plain_cache), f"{prefix}-absorbed-mla-qknorm": step(qk, qk_cache)})
    compiled_modes = [m for m in modes if m != "eager"]
    if compiled_modes:
        from qkmla.attention.decode import decode_one_token, mla_decode_step
        from qkmla.cpu import optimize_for_decode

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        torch._dynamo.reset()

        def compiled_step(module, cache):
            restore, compiled = keeper(cache), torch.compile(mla_decode_step, fullgraph=True, backend=backend)

            def run():
                decode_one_token(module, x, cache, step=compiled)
                restore()
            return run

        for mode in compiled_modes:
            if mode not in ("compiled", "compiled-optimized"):
                raise ValueError(f"modes: expected eager, compiled or compiled-optimized, got {mode!r}")
            pair = (plain, qk)
            if mode == "compiled-optimized":  # twins holding the same weights, with the CPU opt-in
                pair = tuple(optimize_for_decode(twin(m)) for m in pair)
            try:  # compiled here, under the mode the timing runs in; a failure leaves the mode out
                both = {f"{prefix}-absorbed-mla-{mode}": compiled_step(pair[0], plain_cache),
                        f"{prefix}-absorbed-mla-qknorm-{mode}": compiled_step(pair[1], qk_cache)}
                with torch.inference_mode():
                    for fn in both.values():
                        fn()
            except Exception as e:  # noqa: BLE001 - reported to bench_decode.py, which goes on
                errors[mode] = f"{type(e).__name__}: {e}"[:500]
                continue
            fns.update(both)
    return fns


def twin(module):
    """Another MLA holding ``module``'s parameter tensors (as bench_decode.py's twin)."""
    from qkmla import MLA

    other = MLA(module.config).to(device=module.o_proj.weight.device, dtype=module.o_proj.weight.dtype)
    other.load_state_dict(module.state_dict(), strict=False, assign=True)
    return other.eval()


def timed(fn) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main() -> int:
    reply, sys.stdout = sys.stdout, sys.stderr  # the protocol owns the real stdout
    fns: dict = {}
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "setup":  # outside inference mode, as bench_decode.py builds its modules
            fns.clear()
            errors: dict = {}
            fns = setup(msg["preset"], msg["context"], msg["dtype"], msg["device"], msg["batch"],
                        msg.get("prefix", "old"), msg.get("modes", ["eager"]), msg.get("backend", "inductor"), errors)
            import qkmla
            answer = {"qkmla": qkmla.__file__, "variants": list(fns), "torch_threads": torch.get_num_threads(),
                      "compile_errors": errors}
        elif msg["cmd"] == "quit":
            return 0
        else:
            with torch.inference_mode():  # as bench_decode.py times its own variants
                if msg["cmd"] == "warm":
                    fns[msg["name"]]()
                    answer = {"seconds": timed(fns[msg["name"]])}
                elif msg["cmd"] == "round":
                    fns[msg["name"]]()  # untimed, as bench_decode.py does for its own variants
                    answer = {"samples": [timed(fns[msg["name"]]) for _ in range(msg["n"])]}
                else:
                    answer = {"error": f"unknown command {msg['cmd']!r}"}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
