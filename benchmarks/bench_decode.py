"""One decode step of one MLA layer at long context: what the QK-norm scalar cache costs.

Variants (all QK-normed ones use blockwise RMS):

    full-key-qknorm      cache of normalized full keys and values, SDPA over them (the naive cache)
    expand-qknorm        latent cache, every key re-expanded with W_UK each step (HF-style)
    absorbed-mla         plain MLA, absorbed (the baseline every ratio is taken against)
    absorbed-mla-qknorm  QK-normed MLA, absorbed, latent cache + one scalar per token and group
    floor-absorbed       no step: the bytes an absorbed QK-norm step must read (every weight
                         matrix and the cache), each read once by matrix-vector products

A step is ``MLA.forward`` on one new token: projections, cache write, attention over the
context, W_UV and o_proj. The context-dependent part alone is also timed (core-*): for the
absorbed paths ``latent_attention``, for the expand path the re-expansion of every cached
latent plus SDPA over the keys. At short contexts the projections' weights dominate a step
and would hide any overhead in the core.

No absorbed step can avoid reading the layer's weights and the cache: floor-absorbed times
just that, each byte read once (``byte_floor``). It is a measured floor, not a proof: a step
that reads faster than these matrix-vector products could beat it, and the attention's GEMMs
do h (2 d_c + d_r) / (d_c + d_r) times the floor's arithmetic per cached row (30 at the
DeepSeek-V3 width), so a real step also pays for its flops. ``expand_over_floor`` is the
expand / absorbed ratio of a step that cost only its reads; ``fastest_over_floor`` is how
far the fastest QK-normed step is from that.

The absorbed steps also run in other modes of this code, side by side with the rows above
(which are the eager mode):

    eager       plain ``MLA.forward``, no opt-in, no compile (no suffix)
    optimized   after ``qkmla.cpu.optimize_for_decode(model)`` (suffix ``-optimized``)
    compiled    ``attention.decode.decode_one_token`` with ``torch.compile(mla_decode_step,
                fullgraph=True)`` (suffix ``-compiled``)
    compiled-optimized  both: the compiled step of the opt-in's model (suffix
                ``-compiled-optimized``)

A compile failure is recorded in the JSON (``compile.per_context``, by the rows' suffix:
``compiled``, ``compiled-optimized``, ``fp8-compiled``, ...) and the run goes on without those
rows at that context. Every mode's step reads the same cache, and the
optimized and compiled modules hold the eager modules' weight tensors. The expand step runs
eager only (its re-expansion is nearly all of it); ratios to it are given per mode.

With ``--old-commit REV`` or ``--old-src DIR`` the step also runs as another commit's code
runs it (``old-absorbed-mla``, ``old-absorbed-mla-qknorm``, mode ``old``): a worker process
(bench_decode_old.py) imports that checkout's package and times its step when told, in the
same rounds as everything else. ``--old-commit`` checks the commit out into a temporary git
worktree and removes it at the end; without either flag no git is needed.

The old step runs in a lean process (two layers, two caches), the new modes in this one,
which holds every variant's modules and caches (the full-key cache alone is hundreds of MB
at 16k): a difference of a few percent between the two can be the processes, not the code.
So a second worker runs the current tree's step in the same harness as the old one
(``worker-absorbed-mla[-qknorm][-<mode>]`` in the modes eager, compiled, compiled-optimized),
and the summary compares the new code with the old both ways: the fastest in-process mode
(``fastest_over_old_step``) and the fastest worker mode (``worker_fastest_over_old_step``).

With ``--kv-formats F [F ...]`` (bf16, fp8, int8, int4; ``qkmla.kv_formats``) the absorbed
step of plain and QK-normed MLA also runs over a latent cache in each format, in the eager
mode and, when ``compiled`` is among the modes, the compiled one (the compiled step encodes
the new row in the cache's format; its attention, the op ``qkmla::latent_attention``,
dequantizes a chunk of keys at a time). bf16 is the dense cache in bfloat16, the baseline the
formats are compared against: it runs whenever any format does. The model stays in
``--dtype`` (a quantized cache returns its latent in that dtype), and every format's cache
keeps the key scalars in bfloat16, so the bytes differ by the latent row only. The rows are
named

    absorbed-mla[-qknorm]-<format>[-compiled]     e.g. absorbed-mla-qknorm-fp8-compiled

(``step_variant``); the rows without a format read the dense ``--dtype`` cache as before.
Each format's cache is filled through its own codec (``LatentCache.append``) from the same
random rows as the ``--dtype`` cache, so it stores real codes and scales; plain MLA's cache
shares the QK-normed one's latent rows. Summary: each format's step over bf16's, per mode
and context (``kv_format_over_bf16_step``), and its bytes read per step over bf16's
(``kv_format_over_bf16_bytes``, the same at every context; ``kv_format_bytes_per_token``).
The issue's speed target (fp8 reads fewer bytes and runs faster than bf16 from 32k) is asked
of the GPU kernel: ``targets`` evaluates it on the eager rows on a GPU only.

Timing: every variant runs once per round, rounds interleave the variants (so drift hits all
alike), and the median over rounds is reported. The cache is filled with random rows, and
its lengths are restored after every step so each step sees the same context. Each row also
records its minor page faults per timed call (``page_faults_per_call``): under glibc's
default allocator the expand step's hundreds of MB per call are fresh pages every time,
which a caching allocator (jemalloc, tcmalloc, ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` set high) avoids; ``machine.allocator_env`` and the recorded
command name the allocator settings a run had.

    python benchmarks/bench_decode.py [--quick] [--preset deepseek-v3-tp8] [--out FILE.json]
        [--old-commit REV | --old-src DIR] [--modes eager optimized compiled] [--kv-formats bf16 fp8 int8 int4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    import resource
except ImportError:  # Windows has no resource module: its rows carry no page-fault counts
    resource = None

from qkmla import MLA, FullKVCache, LatentCache, mla_preset
from qkmla.attention.decode import decode_one_token, mla_decode_step
from qkmla.attention.functional import sdpa
from qkmla.cache import KV_FORMATS
from qkmla.cpu import optimize_for_decode
from qkmla.machine import machine, recorded_command, source_commit
from qkmla.ops.mla_decode.torch_impl import latent_attention

HERE = Path(__file__).resolve().parent
VARIANTS = ("full-key-qknorm", "expand-qknorm", "absorbed-mla", "absorbed-mla-qknorm",
            "core-expand-qknorm", "core-mla", "core-mla-qknorm", "floor-absorbed")
MODES = ("eager", "optimized", "compiled", "compiled-optimized")
DEFAULT_MODES = MODES
OLD = "old"  # the mode name of the other commit's rows
WORKER = "worker"  # the prefix of the current tree's rows timed in a worker, as the old ones
WORKER_MODES = ("eager", "compiled", "compiled-optimized")
# --kv-formats: the dense bfloat16 cache (the baseline) and the quantized formats.
BENCH_KV_FORMATS = ("bf16",) + tuple(f for f in KV_FORMATS if f != "dense")
KV_FORMAT_MODES = ("eager", "compiled")  # the modes the --kv-formats rows run in


def step_variant(mode: str, qk_norm: bool, kv_format: str | None = None) -> str:
    """The row name of the absorbed step of plain (qk_norm=False) or QK-normed MLA in a mode,
    over the dense --dtype cache (kv_format None) or a cache of a --kv-formats format."""
    name = "absorbed-mla-qknorm" if qk_norm else "absorbed-mla"
    if kv_format is not None:
        name += f"-{kv_format}"
    return {"eager": name, OLD: f"old-{name}"}.get(mode, f"{name}-{mode}")


def mode_variants(modes, kv_formats=()) -> tuple:
    """Every row name of a run with these modes and --kv-formats formats (bf16 first), in
    the order they are timed and written."""
    extra = tuple(step_variant(m, q) for m in modes if m != "eager" for q in (False, True))
    formats = tuple(step_variant(m, q, f) for f in kv_formats for m in KV_FORMAT_MODES if m in modes
                    for q in (False, True))
    return VARIANTS + extra + formats


def filled(cache, context: int, rows: dict):
    """Append ``context`` random tokens, as a prefill would, without running the model."""
    cache.write_rows(cache.plan(cache.batch_size, context), rows)
    return cache


def format_cache(config, kv_format: str, batch: int, capacity: int, dtype: torch.dtype, device: str) -> LatentCache:
    """An empty latent cache of a --kv-formats format: "bf16" is the dense cache in bfloat16,
    a quantized one returns its latent in ``dtype``; the key scalars are bfloat16 in every one."""
    dense = kv_format == "bf16"
    return LatentCache.from_config(config, batch, capacity, dtype=torch.bfloat16 if dense else dtype,
                                   scalar_dtype=torch.bfloat16, device=device,
                                   kv_format="dense" if dense else kv_format)


def appended(cache: LatentCache, latent: torch.Tensor, key_scale: torch.Tensor | None = None) -> LatentCache:
    """Append rows [c ; k^R] (and key scalars) through the cache's own codec, as a prefill would."""
    d_c = cache.kv_lora_rank
    slot = cache.plan(cache.batch_size, latent.shape[1])
    cache.append(slot, c_kv=latent[..., :d_c], k_rope=latent[..., d_c:], key_scale=key_scale)
    return cache


def byte_floor(module: MLA, latent: torch.Tensor, key_scale: torch.Tensor):
    """A call that reads what every absorbed decode step of ``module`` must read, each byte once,
    as matrix-vector products (the least arithmetic a full read through BLAS does): one token
    through every weight matrix with ``F.linear`` (the projections; kv_b_proj holds the bytes
    of W_UK and W_UV), each sequence's cache rows latent[b] [S, d_c + d_r] times one vector,
    and a sum of the key scalars [B, S, G].

    It computes far less than a step: per cached row the attention's score and value GEMMs
    do 2 h (2 d_c + d_r) flops, this read 2 (d_c + d_r)."""
    weights = [m.weight for m in module.modules() if isinstance(m, torch.nn.Linear)]
    tokens = [w.new_ones(latent.shape[0], 1, w.shape[1]) for w in weights]
    vector = latent.new_ones(latent.shape[-1])

    def run():
        for x, w in zip(tokens, weights):
            torch.nn.functional.linear(x, w)
        for rows in latent:  # [S, d_c + d_r] each, contiguous rows of the cache
            torch.mv(rows, vector)
        key_scale.sum()
    return run


def twin(module: MLA, config=None) -> MLA:
    """Another MLA holding ``module``'s parameter tensors (not copies of them)."""
    other = MLA(config or module.config).to(device=module.o_proj.weight.device, dtype=module.o_proj.weight.dtype)
    other.load_state_dict(module.state_dict(), strict=False, assign=True)
    return other.eval()


def setup(preset: str, context: int, dtype: torch.dtype, device: str, batch: int = 1, modes=("eager",),
          compile_info: dict | None = None, compile_backend: str = "inductor", kv_formats=()):
    """Modules and caches for every variant at one context length.

    ``compile_info`` (a dict) receives, for each pair of compiled rows (keyed by their suffix:
    the mode, or "<format>-compiled"), the seconds of the first call (the compile), the largest
    difference between the compiled and the eager step's outputs, or the compile error (and
    those rows are then left out). ``kv_formats``: the --kv-formats formats, bf16 first."""
    torch.manual_seed(0)
    cfg = mla_preset(preset)
    qk = MLA(cfg).to(device=device, dtype=dtype).eval()
    plain = twin(qk, cfg.replace(qk_norm=None))
    # Plain MLA reads the QK-normed layer's own projection weights (the same tensors), and
    # its cache's latent rows are the same buffer: the step ratio then measures the
    # attention arithmetic, not where the allocator placed 140 MB of weights (two separately
    # allocated pairs differ by up to ±3% on the 2-core CPU VM from placement alone).
    capacity, B = context + 1, batch
    d_c, d_r, G = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_kv_groups
    latent = torch.randn(B, context, d_c + d_r, dtype=dtype, device=device)
    key_scale = torch.rand(B, context, G, dtype=dtype, device=device) + 0.5
    kw = dict(dtype=dtype, device=device)
    caches = {
        "full-key-qknorm": filled(FullKVCache.from_config(cfg, B, capacity, **kw), context, {
            "k": torch.randn(B, context, G * cfg.qk_head_dim, dtype=dtype, device=device),
            "v": torch.randn(B, context, G * cfg.v_head_dim, dtype=dtype, device=device)}),
        "expand-qknorm": filled(LatentCache.from_config(cfg, B, capacity, **kw), context,
                                {"latent": latent, "key_scale": key_scale}),
        "absorbed-mla": filled(LatentCache.from_config(plain.config, B, capacity, **kw), context, {"latent": latent}),
    }
    caches["absorbed-mla-qknorm"] = caches["expand-qknorm"]  # same cache object, different path
    # The same latent rows for plain MLA. Each step writes its new row at slot `context`
    # before reading it, and the rows before it are never written, so sharing is safe.
    caches["absorbed-mla"].fields["latent"].data = caches["expand-qknorm"].fields["latent"].data
    for fmt in kv_formats:  # the same rows again, stored by each format's codec; shared the same way
        fmt_qk = appended(format_cache(cfg, fmt, B, capacity, dtype, device), latent, key_scale)
        fmt_plain = appended(format_cache(plain.config, fmt, B, capacity, dtype, device), latent)
        fmt_plain.fields["latent"].data = fmt_qk.fields["latent"].data
        caches[step_variant("eager", False, fmt)], caches[step_variant("eager", True, fmt)] = fmt_plain, fmt_qk
    x = torch.randn(B, 1, cfg.hidden_size, dtype=dtype, device=device)
    q_lat = torch.randn(B, 1, cfg.num_heads, d_c, dtype=dtype, device=device)
    q_rope = torch.randn(B, 1, cfg.num_heads, d_r, dtype=dtype, device=device)
    q_full = torch.randn(B, 1, cfg.num_heads, cfg.qk_head_dim, dtype=dtype, device=device)

    def step(module, cache, path="auto"):
        saved = cache.bookkeeping()

        def run():
            module(x, cache, path=path)
            cache.restore(saved)  # keep the context fixed
        return run

    def compiled_step(module, cache, compiled):
        saved = cache.bookkeeping()

        def run():
            decode_one_token(module, x, cache, step=compiled)
            cache.restore(saved)
        return run

    lat = caches["expand-qknorm"].fields["latent"].read(context)
    scal = caches["expand-qknorm"].fields["key_scale"].read(context)
    fns = {
        "full-key-qknorm": step(qk, caches["full-key-qknorm"]),
        "expand-qknorm": step(qk, caches["expand-qknorm"], "expand"),
        "absorbed-mla": step(plain, caches["absorbed-mla"], "absorbed"),
        "absorbed-mla-qknorm": step(qk, caches["absorbed-mla-qknorm"], "absorbed"),
        "core-expand-qknorm": lambda: sdpa(q_full, *qk.expand_cache(lat, scal), cfg.scale),
        "core-mla": lambda: latent_attention(q_lat, q_rope, lat, None, cfg.scale),
        "core-mla-qknorm": lambda: latent_attention(q_lat, q_rope, lat, scal, cfg.scale),
        "floor-absorbed": byte_floor(qk, lat, scal),
    }
    for fmt in kv_formats:
        for module, qk_norm in ((plain, False), (qk, True)):
            name = step_variant("eager", qk_norm, fmt)
            fns[name] = step(module, caches[name], "absorbed")
    if "optimized" in modes or "compiled-optimized" in modes:  # twins sharing the weights, with the CPU opt-in
        qk_opt, plain_opt = optimize_for_decode(twin(qk)), optimize_for_decode(twin(plain))
    if "optimized" in modes:
        fns["absorbed-mla-optimized"] = step(plain_opt, caches["absorbed-mla"], "absorbed")
        fns["absorbed-mla-qknorm-optimized"] = step(qk_opt, caches["absorbed-mla-qknorm"], "absorbed")
    if any(m.startswith("compiled") for m in modes):
        torch._dynamo.reset()  # one compile per module and context, none left from the last context
    compiled_pairs = [(m, None) for m in modes if m.startswith("compiled")]
    compiled_pairs += [("compiled", fmt) for fmt in kv_formats if "compiled" in modes]
    for mode, fmt in compiled_pairs:
        pair = (plain, qk) if mode == "compiled" else (plain_opt, qk_opt)
        key = mode if fmt is None else f"{fmt}-{mode}"  # the rows' suffix
        info = compile_info.setdefault(key, {}) if compile_info is not None else {}
        try:
            compiled = torch.compile(mla_decode_step, fullgraph=True, backend=compile_backend)
            runs, diff = {}, {}
            for module, qk_norm in zip(pair, (False, True)):
                name = step_variant("eager", qk_norm, fmt)
                cache, saved = caches[name], caches[name].bookkeeping()
                t0 = time.perf_counter()
                with torch.inference_mode():  # compiled here, under the mode the timing runs in
                    y_compiled = decode_one_token(module, x, cache, step=compiled)
                    cache.restore(saved)
                    info.setdefault("compile_seconds", {})[name] = time.perf_counter() - t0
                    y_eager = module(x, cache, path="absorbed")
                    cache.restore(saved)
                diff[name] = float((y_compiled - y_eager).abs().max())
                runs[step_variant(mode, qk_norm, fmt)] = compiled_step(module, cache, compiled)
            info["max_abs_diff_to_eager"] = diff
            fns.update(runs)
        except Exception as e:  # noqa: BLE001 -- any failure to compile is a result, recorded
            info["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    assert all(p.data_ptr() == qk.get_parameter(n).data_ptr() for n, p in plain.named_parameters())
    for name in ("full-key-qknorm", "expand-qknorm", "absorbed-mla",
                 *(step_variant("eager", True, fmt) for fmt in kv_formats)):
        c = caches[name]
        assert c.nbytes == c.bytes_per_token * c.capacity * c.batch_size  # measured allocation == formula
    cache_of = {**caches, "core-mla": caches["absorbed-mla"], "core-mla-qknorm": caches["absorbed-mla-qknorm"],
                "core-expand-qknorm": caches["expand-qknorm"], "floor-absorbed": caches["absorbed-mla-qknorm"]}
    for name in fns:
        if name not in cache_of:  # every mode's step reads the eager step's cache
            cache_of[name] = caches[step_variant("eager", "qknorm" in name, kv_format_of(name))]
    cache_bytes = {name: cache_of[name].bytes_per_token * context * batch for name in fns}
    return fns, cache_bytes


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class OldWorker:
    """bench_decode_old.py in a child process that imports the qkmla under ``src``."""

    def __init__(self, src: Path, label: str = "old-commit worker"):
        self.label = label
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "bench_decode_old.py")], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.label} exited (status {self.proc.wait()}); its stderr is above")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.label}: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


class Remote:
    """A variant timed by the worker: ``warm()`` is one timed call after an untimed one,
    ``round(n)`` one untimed call and n timed ones, as time_side_by_side does locally."""

    def __init__(self, worker: OldWorker, name: str):
        self.worker, self.name = worker, name

    def warm(self) -> float:
        return self.worker.ask(cmd="warm", name=self.name)["seconds"]

    def round(self, n: int) -> list[float]:
        return self.worker.ask(cmd="round", name=self.name, n=n)["samples"]


def minor_faults() -> int | None:
    """Page faults this process has taken so far without reading the disk (None where the OS
    does not report them): first touches of freshly mapped memory, the cost of allocating
    hundreds of MB per call."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else None


def time_side_by_side(fns: dict, rounds: int, device: str, budget_s: float) -> tuple[dict, dict, dict]:
    """Median seconds per call, variants interleaved round by round, each round's median, and
    the median over rounds of the page faults per timed call (None for a :class:`Remote`
    variant, which runs in another process).

    In every round each variant gets one untimed call first (a variant that follows one
    that freed hundreds of MB would otherwise pay for page faults and cold caches), then
    a few timed calls: as many as fit in ~100 ms, at least one. A slow variant stops after
    3 rounds once it has spent ``budget_s``. The per-round medians let a ratio be taken
    round by round, between calls made seconds apart, which shows how much of a ratio is
    the machine's drift. A :class:`Remote` variant is timed the same way by the old-commit
    worker while this process waits.
    """
    samples = {name: [] for name in fns}
    per_round = {name: [] for name in fns}
    faults = {name: [] for name in fns}
    per_call = {}
    with torch.inference_mode():
        for name, fn in fns.items():  # warm-up, and a first estimate of the cost
            if isinstance(fn, Remote):
                per_call[name] = fn.warm()
                continue
            fn()
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            per_call[name] = time.perf_counter() - t0
        for r in range(rounds):
            for name, fn in fns.items():
                if r >= 3 and sum(samples[name]) > budget_s:
                    continue
                calls = max(1, min(50, int(0.1 / per_call[name])))
                if isinstance(fn, Remote):  # the worker times its own calls, the same way
                    samples[name] += (this_round := fn.round(calls))
                    per_round[name].append(statistics.median(this_round))
                    continue
                fn()
                this_round, faults_before = [], minor_faults()
                for _ in range(calls):
                    sync(device)
                    t0 = time.perf_counter()
                    fn()
                    sync(device)
                    this_round.append(time.perf_counter() - t0)
                if faults_before is not None:
                    faults[name].append((minor_faults() - faults_before) / calls)
                samples[name] += this_round
                per_round[name].append(statistics.median(this_round))
    return ({name: statistics.median(s) for name, s in samples.items()}, per_round,
            {name: statistics.median(f) if f else None for name, f in faults.items()})


def round_ratios(per_round: dict, a: str, b: str) -> list[float]:
    """[25th, 50th, 75th] percentiles of a's time over b's, round by round."""
    ratios = [x / y for x, y in zip(per_round[a], per_round[b], strict=True)]
    return [float(q) for q in statistics.quantiles(ratios, n=4, method="inclusive")] if len(ratios) > 1 else ratios * 3


def worker_variant(mode: str, qk_norm: bool) -> str:
    """The row name of the current tree's step timed by a worker in ``mode`` (WORKER_MODES)."""
    return f"{WORKER}-" + step_variant(mode, qk_norm)


def mode_of(name: str) -> str:
    """The mode a step row runs in ("eager" for every row without a mode's suffix)."""
    if name.startswith("old-"):
        return OLD
    return next((m for m in sorted(MODES, key=len, reverse=True) if m != "eager" and name.endswith(f"-{m}")), "eager")


def kv_format_of(name: str) -> str | None:
    """The --kv-formats format a step row reads (None for the rows over the --dtype cache)."""
    core = name.removesuffix(f"-{mode_of(name)}")
    return next((f for f in BENCH_KV_FORMATS if core.endswith(f"-{f}")), None)


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout.strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="contexts 1k and 4k, few rounds (a smoke run)")
    p.add_argument("--preset", default="deepseek-v3-tp8")
    p.add_argument("--contexts", type=int, nargs="*", help="context lengths (default 1k..32k)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES),
                   help=f"modes of the absorbed step to time (default: {' '.join(DEFAULT_MODES)}; eager always runs)")
    p.add_argument("--kv-formats", nargs="+", choices=BENCH_KV_FORMATS, default=[], metavar="F",
                   help="also time the absorbed step over a latent cache in each format "
                        f"({', '.join(BENCH_KV_FORMATS)}; "
                        "bf16, the dense bfloat16 cache, always runs with them as the baseline), in the modes "
                        f"{' and '.join(KV_FORMAT_MODES)} (default: none)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled modes (default inductor; aot_eager for a fast smoke run)")
    old_from = p.add_mutually_exclusive_group()
    old_from.add_argument("--old-commit", metavar="REV",
                          help="also time this commit's step (checked out into a temporary git worktree)")
    old_from.add_argument("--old-src", type=Path, metavar="DIR",
                          help="also time the step of the qkmla package under DIR (a checkout's src/)")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default benchmarks/results/bench_decode_<device>.json)")
    args = p.parse_args(argv)
    contexts = args.contexts or ([1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768])
    rounds = args.rounds or (5 if args.quick else 21)
    dtype = getattr(torch, args.dtype)
    modes = ["eager"] + [m for m in MODES if m in args.modes and m != "eager"]
    kv_formats = [f for f in BENCH_KV_FORMATS if f in args.kv_formats or (f == "bf16" and args.kv_formats)]
    if args.old_src is not None and not (args.old_src / "qkmla" / "__init__.py").is_file():
        p.error(f"--old-src: {args.old_src} holds no qkmla package (expected {args.old_src}/qkmla/__init__.py)")
    if any(m.startswith("compiled") for m in modes):
        # A compiled step per module and context; the default limit would fall back to eager.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    info = machine()
    print(f"# {info['cpu']} ({info['cores']} cores, {info['torch_threads']} torch threads)"
          f"{', ' + info['gpu'] if 'gpu' in info else ''}, torch {info['torch']}, {args.preset}, {args.dtype}, "
          f"batch {args.batch}, modes {' '.join(modes)}"
          + (f", kv formats {' '.join(kv_formats)}" if kv_formats else "")
          + f", allocator env {info['allocator_env'] or 'none (C library defaults)'}")

    old, worker, same_harness, tmp, worker_modes = None, None, None, None, []
    try:
        if args.old_commit or args.old_src:
            if args.old_commit:
                repo = HERE.parent
                rev = git("rev-parse", "--verify", f"{args.old_commit}^{{commit}}", cwd=repo)
                tmp = Path(tempfile.mkdtemp(prefix="qkmla-old-"))
                git("worktree", "add", "--detach", str(tmp / "tree"), rev, cwd=repo)
                src = tmp / "tree" / "src"
            else:
                src = args.old_src.resolve()
                try:
                    rev = git("rev-parse", "HEAD", cwd=src)
                except (subprocess.CalledProcessError, OSError):
                    rev = None
            worker = OldWorker(src)
            old = {"rev": rev, "src": str(src)}
            print(f"# old step: commit {rev} from {src}")
            same_harness = OldWorker(HERE.parent / "src", label="same-harness worker")
            worker_modes = [m for m in WORKER_MODES if m in modes]
        rows, spread, compile_record, worker_spread = [], {"step": {}, "core": {}}, {}, {}
        spread_by_mode = {m: {} for m in modes + ([OLD] if worker else [])}
        print(f"{'context':>8} {'variant':<40}{'seconds':>12}{'cache bytes':>14}{'ratio to mla':>14}{'page faults':>14}")
        for context in contexts:
            compile_info = {}
            fns, cache_bytes = setup(args.preset, context, dtype, args.device, args.batch, modes, compile_info,
                                     args.compile_backend, kv_formats)
            if compile_info:
                compile_record[context] = compile_info
                for key, got in compile_info.items():
                    if "error" in got:
                        print(f"# {context}: the {key} rows failed to compile, left out: {got['error']}")
            if worker:
                answer = worker.ask(cmd="setup", preset=args.preset, context=context, dtype=args.dtype,
                                    device=args.device, batch=args.batch)
                old.update(qkmla=answer["qkmla"], torch_threads=answer["torch_threads"])
                if not answer["qkmla"].startswith(str(old["src"])):
                    raise RuntimeError(f"the old-commit worker imported {answer['qkmla']}, not the package under {old['src']}")
                for qk_norm in (False, True):
                    fns[step_variant(OLD, qk_norm)] = Remote(worker, step_variant(OLD, qk_norm))
                    cache_bytes[step_variant(OLD, qk_norm)] = cache_bytes[step_variant("eager", qk_norm)]
                answer = same_harness.ask(cmd="setup", preset=args.preset, context=context, dtype=args.dtype,
                                          device=args.device, batch=args.batch, prefix=WORKER, modes=worker_modes,
                                          backend=args.compile_backend)
                if not answer["qkmla"].startswith(str(HERE.parent / "src")):
                    raise RuntimeError(f"the same-harness worker imported {answer['qkmla']}, not this tree's package")
                for m, error in answer["compile_errors"].items():
                    compile_record.setdefault(context, {})[f"{WORKER}-{m}"] = {"error": error}
                    print(f"# {context}: the {WORKER}-{m} rows failed to compile, left out: {error}")
                for name in answer["variants"]:
                    fns[name] = Remote(same_harness, name)
                    cache_bytes[name] = cache_bytes[step_variant("eager", "-qknorm" in name)]
            seconds, per_round, faults = time_side_by_side(fns, rounds, args.device, budget_s=20.0)
            spread["step"][context] = round_ratios(per_round, "absorbed-mla-qknorm", "absorbed-mla")
            spread["core"][context] = round_ratios(per_round, "core-mla-qknorm", "core-mla")
            worker_spread[context] = {(m, q): round_ratios(per_round, worker_variant(m, q), step_variant(OLD, q))
                                      for m in worker_modes for q in (False, True)
                                      if worker_variant(m, q) in per_round}
            for m, spread_m in spread_by_mode.items():
                if step_variant(m, True) in per_round:
                    spread_m[context] = round_ratios(per_round, step_variant(m, True), step_variant(m, False))
            for name in fns:
                if name.startswith("core"):
                    base = "core-mla"  # like against like
                elif name.startswith(("absorbed", "old-")):
                    base = step_variant(mode_of(name), False, kv_format_of(name))  # plain MLA, same mode and cache
                elif name.startswith(f"{WORKER}-"):
                    base = name.replace("-qknorm", "")
                else:
                    base = "absorbed-mla"
                row = {"context": context, "variant": name, "seconds": seconds[name],
                       "cache_bytes": cache_bytes[name], "ratio_to_mla": seconds[name] / seconds[base],
                       "page_faults_per_call": faults[name]}
                rows.append(row)
                print(f"{context:>8} {name:<40}{row['seconds']:>12.6f}{row['cache_bytes']:>14,}"
                      f"{row['ratio_to_mla']:>14.3f}" + ("" if faults[name] is None else f"{faults[name]:>14,.0f}"))
            del fns
    finally:
        for w in (worker, same_harness):
            if w:
                w.close()
        if tmp is not None:
            subprocess.run(["git", "-C", str(HERE.parent), "worktree", "remove", "--force", str(tmp / "tree")],
                           check=False)
            shutil.rmtree(tmp, ignore_errors=True)

    by = {(r["context"], r["variant"]): r["seconds"] for r in rows}

    def ratio(ctx, a, b):
        return by[(ctx, a)] / by[(ctx, b)] if (ctx, a) in by and (ctx, b) in by else None

    def per_context(fn) -> dict:
        """{context: fn(context)} where fn has a value."""
        return {c: v for c in contexts if (v := fn(c)) is not None}

    all_modes = modes + ([OLD] if worker else [])
    step_by_mode = {m: per_context(lambda c, m=m: ratio(c, step_variant(m, True), step_variant(m, False)))
                    for m in all_modes}
    expand_by_mode = {m: per_context(lambda c, m=m: ratio(c, "expand-qknorm", step_variant(m, True))) for m in modes}

    def fastest(c):  # the new code's mode with the shortest QK-normed step at context c
        timed = [m for m in modes if (c, step_variant(m, True)) in by]
        return min(timed, key=lambda m: by[(c, step_variant(m, True))])

    def plain_and_qk(fn) -> dict:
        """fn(qk_norm) for plain MLA and QK-normed MLA."""
        return {"mla": fn(False), "mla-qknorm": fn(True)}

    def against(c, mode, other, kv_format=None, other_format=None) -> dict | None:
        """Steps in ``mode`` over a ``kv_format`` cache over steps in ``other`` over an ``other_format`` one."""
        both = plain_and_qk(lambda q: ratio(c, step_variant(mode, q, kv_format), step_variant(other, q, other_format)))
        return None if None in both.values() else both

    fastest_mode = {c: fastest(c) for c in contexts}
    summary = {
        # The eager rows (plain MLA.forward), as before the modes existed:
        "qknorm_over_mla_step": {c: ratio(c, "absorbed-mla-qknorm", "absorbed-mla") for c in contexts},
        "qknorm_over_mla_core": {c: ratio(c, "core-mla-qknorm", "core-mla") for c in contexts},
        # The same ratios taken round by round: [25th, 50th, 75th] percentiles over rounds.
        "qknorm_over_mla_step_per_round_quartiles": spread["step"],
        "qknorm_over_mla_core_per_round_quartiles": spread["core"],
        "expand_over_absorbed_qknorm_step": {c: ratio(c, "expand-qknorm", "absorbed-mla-qknorm") for c in contexts},
        "expand_over_absorbed_qknorm_core": {c: ratio(c, "core-expand-qknorm", "core-mla-qknorm") for c in contexts},
        "full_key_cache_over_qknorm_latent_cache": rows[0]["cache_bytes"] / next(
            r["cache_bytes"] for r in rows if r["variant"] == "absorbed-mla-qknorm"),
        # Every mode (and the old commit's step as mode "old"):
        "qknorm_over_mla_step_by_mode": step_by_mode,
        "qknorm_over_mla_step_per_round_quartiles_by_mode": spread_by_mode,
        # The expand step runs eager in every mode (its re-expansion dominates it).
        "expand_over_absorbed_qknorm_step_by_mode": expand_by_mode,
        # What each mode (and the old commit) buys: its step over the eager step, plain and QK-normed.
        "step_over_eager_by_mode": {m: per_context(lambda c, m=m: against(c, m, "eager")) for m in all_modes
                                    if m != "eager"},
        "fastest_mode": fastest_mode,
        "qknorm_over_mla_step_fastest": per_context(lambda c: step_by_mode[fastest_mode[c]].get(c)),
        "expand_over_absorbed_qknorm_step_fastest": per_context(lambda c: expand_by_mode[fastest_mode[c]].get(c)),
        # The bytes an absorbed step must read, read once (floor-absorbed): the expand / absorbed
        # ratio of a step that cost only that, and how far the fastest QK-normed step is from it.
        "expand_over_floor": per_context(lambda c: ratio(c, "expand-qknorm", "floor-absorbed")),
        "fastest_over_floor": per_context(lambda c: ratio(c, step_variant(fastest_mode[c], True), "floor-absorbed")),
    }
    if worker:
        summary["fastest_over_old_step"] = per_context(
            lambda c: {"mode": fastest_mode[c], **against(c, fastest_mode[c], OLD)})
        summary["eager_over_old_step"] = per_context(lambda c: against(c, "eager", OLD))

        def worker_over_old(c, m) -> dict | None:  # worker mode m's steps over the old ones (None: not timed)
            both = plain_and_qk(lambda q: ratio(c, worker_variant(m, q), step_variant(OLD, q)))
            return None if None in both.values() else both

        def worker_fastest(c):  # the worker mode with the shortest QK-normed step
            timed = [m for m in worker_modes if worker_over_old(c, m) is not None]
            if not timed:
                return None
            m = min(timed, key=lambda m: by[(c, worker_variant(m, True))])
            return {"mode": m, **worker_over_old(c, m)}
        summary["worker_fastest_over_old_step"] = per_context(worker_fastest)
        # The same ratios taken round by round, [25th, 50th, 75th] percentiles: how much is drift.
        summary["worker_fastest_over_old_step_per_round_quartiles"] = {
            c: plain_and_qk(lambda q, c=c, m=v["mode"]: worker_spread[c][(m, q)])
            for c, v in summary["worker_fastest_over_old_step"].items()}
        summary["worker_over_old_step_by_mode"] = {m: per_context(lambda c, m=m: worker_over_old(c, m))
                                                   for m in worker_modes}
    quantized = [f for f in kv_formats if f != "bf16"]
    if kv_formats:  # bytes per token are those of the first context's rows (bytes_per_token x context)
        cache_bytes_of = {(r["context"], r["variant"]): r["cache_bytes"] for r in rows}
        per_token = {f: plain_and_qk(lambda q, f=f: cache_bytes_of[(contexts[0], step_variant("eager", q, f))]
                                     // (contexts[0] * args.batch)) for f in kv_formats}
        summary.update({
            "kv_format_bytes_per_token": per_token,
            "kv_format_over_bf16_bytes": {f: {k: v / per_token["bf16"][k] for k, v in per_token[f].items()}
                                          for f in quantized},
            # {mode: {format: {context: {"mla", "mla-qknorm"}}}}: each format's step over bf16's, same mode.
            "kv_format_over_bf16_step": {m: {f: per_context(lambda c, m=m, f=f: against(c, m, m, f, "bf16"))
                                             for f in quantized} for m in KV_FORMAT_MODES if m in modes},
        })
    long = [v for c, v in summary["qknorm_over_mla_step_fastest"].items() if c >= 4096]
    at16k = summary["expand_over_absorbed_qknorm_step_fastest"].get(16384)
    vs_old = [v for c in (4096, 16384) if worker and c in contexts
              for v in summary["fastest_over_old_step"][c].values() if not isinstance(v, str)]
    vs_old_same = [v for c in (4096, 16384) if worker and c in summary["worker_fastest_over_old_step"]
                   for v in summary["worker_fastest_over_old_step"][c].values() if not isinstance(v, str)]
    fp8_step = summary.get("kv_format_over_bf16_step", {}).get("eager", {}).get("fp8", {})
    fp8_long = [v for c, d in fp8_step.items() if c >= 32768 for v in d.values()] if args.device == "cuda" else []
    summary["targets"] = {  # None: not measured in this run
        "qknorm_over_mla_step_fastest_le_1.05_from_4k": all(v <= 1.05 for v in long) if long else None,
        "expand_over_absorbed_qknorm_step_fastest_ge_50_at_16k": at16k >= 50 if at16k is not None else None,
        "fastest_no_slower_than_old_at_4k_and_16k": all(v <= 1.0 for v in vs_old) if vs_old else None,
        "fastest_no_slower_than_old_at_4k_and_16k_same_harness": (
            all(v <= 1.0 for v in vs_old_same) if vs_old_same else None),
        # The issue asks it of the GPU kernel (the eager step's decode backend on a GPU): None elsewhere.
        "gpu_fp8_faster_and_fewer_bytes_than_bf16_from_32k": (
            all(v < 1.0 for v in (*fp8_long, *summary["kv_format_over_bf16_bytes"]["fp8"].values()))
            if fp8_long else None),
    }

    def show(d: dict, digits: int = 3) -> dict:
        return {c: round(v, digits) for c, v in d.items()}

    def show_pairs(d: dict, digits: int = 3) -> dict:  # {key: {"mla", "mla-qknorm"}}
        return {c: f"{v['mla']:.{digits}f}, {v['mla-qknorm']:.{digits}f}" for c, v in d.items()}

    print("QK-norm / plain MLA, decode step (eager):", show(summary["qknorm_over_mla_step"]))
    print("QK-norm / plain MLA, attention core:", show(summary["qknorm_over_mla_core"]))
    for part in ("step", "core"):
        print(f"  {part}, round by round (25th/50th/75th percentile):",
              {c: "/".join(f"{v:.3f}" for v in q) for c, q in spread[part].items()})
    print("re-expanding keys / absorbed QK-norm, step (eager):", show(summary["expand_over_absorbed_qknorm_step"], 1))
    print("re-expanding keys / absorbed QK-norm, core:", show(summary["expand_over_absorbed_qknorm_core"], 1))
    print("re-expanding keys / the absorbed step's bytes read once (floor-absorbed):",
          show(summary["expand_over_floor"], 1))
    print("fastest absorbed QK-norm step / its bytes read once:", show(summary["fastest_over_floor"]))
    print(f"full-key cache / QK-normed latent cache bytes: {summary['full_key_cache_over_qknorm_latent_cache']:.2f}x")
    for m in all_modes:
        print(f"QK-norm / plain MLA, step, {m}:", show(step_by_mode[m]),
              "round by round:", {c: "/".join(f"{v:.3f}" for v in q) for c, q in spread_by_mode[m].items()})
    for m in modes:
        print(f"re-expanding keys (eager) / absorbed QK-norm, step, {m}:", show(expand_by_mode[m], 1))
    for m, d in summary["step_over_eager_by_mode"].items():
        print(f"{m} step / eager step (mla, mla-qknorm):", show_pairs(d))
    print("fastest mode:", fastest_mode)
    if worker:
        for key, label in (("fastest_over_old_step", "fastest mode"), ("eager_over_old_step", "eager"),
                           ("worker_fastest_over_old_step", "same harness, fastest worker mode")):
            print(f"{label} step / old commit's step (mla, mla-qknorm):", show_pairs(summary[key]))
    for m, by_format in summary.get("kv_format_over_bf16_step", {}).items():
        for f, d in by_format.items():
            print(f"{f} step / bf16 step, {m} (mla, mla-qknorm):", show_pairs(d))
    if kv_formats:
        print("bytes per token (mla, mla-qknorm):", show_pairs(summary["kv_format_bytes_per_token"], 0),
              "over bf16's:", show_pairs(summary["kv_format_over_bf16_bytes"]))
    print("targets:", summary["targets"])
    suffix = ("_quick" if args.quick else "") + (f"_batch{args.batch}" if args.batch != 1 else "")
    out = args.out or HERE / "results" / f"bench_decode_{args.device}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = recorded_command("benchmarks/bench_decode.py", argv)
    compiled = {"function": "qkmla.attention.decode.mla_decode_step", "fullgraph": True, "backend": args.compile_backend,
                "per_context": compile_record} if compile_record else None
    out.write_text(json.dumps({"command": command, "commit": source_commit(HERE), "machine": info,
                               "preset": args.preset,
                               "dtype": args.dtype, "device": args.device, "batch": args.batch, "rounds": rounds,
                               "modes": all_modes, "kv_formats": kv_formats, "compile": compiled, "old": old,
                               "rows": rows, "summary": summary}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
