"""Launching Triton kernels with the least host work, and value checks that cost one read.

Why. A JIT launch, ``kernel[grid](*args)``, specialises every argument and looks up the
compile cache on every call: several times the host time of the compiled kernel's own
launcher, and a decode call of a few launches is host-bound by that (eager rows: dsv4lab
bench sparse_mla).

:class:`Launch`: one launch of a plan (kernel, grid, the arguments the plan fixes, options).
Its first call goes through the JIT and keeps the compiled kernel; later calls merge the
per-call arguments with the fixed ones, pass tensors as their data pointers and call the
compiled launcher's C entry directly. A call whose tensors' dtypes or alignment differ from
the first call's, on another device, with launch hooks set (a profiler) or under the
interpreter goes through the JIT.

:func:`workspace`: buffers a plan's launches share within one call, kept per (plan, device,
stream) (calls on one stream run in order); fresh while a CUDA graph is captured.

:func:`value_check`: a slot of a per-(device, stream) ring and a stamp, for one call's check
kernel. Each program of the check raises the slot's device flag to ``2 * stamp + bad`` (an
atomic max: no launch zeroes it) and takes a ticket; the last program writes the flag into
the slot's word of pinned host memory (:func:`report_verdict`). :meth:`Verdict.failed`,
after the op's kernels were launched, spins on that word: the host learns the verdict as
soon as the check has run, with no copy, event or stream sync queued behind it.
"""
from __future__ import annotations

import inspect
import time

import torch
import triton
import triton.language as tl

from dsv4lab.kernels.device import interpreting


# ---- the current stream and device, as the JIT reads them ---------------------------------

def stream_of(device: torch.device) -> int:
    """The raw handle of ``device``'s current CUDA stream (0 for a CPU tensor)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph (False on the CPU)."""
    return device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()


def _hooks_active() -> bool:
    """Whether a launch hook is set (Triton's HookChain of 3.6 / 3.9, or a plain callable)."""
    hook = _RUNTIME_KNOBS.launch_enter_hook
    return bool(getattr(hook, "calls", hook))


_RUNTIME_KNOBS = triton.knobs.runtime
_TENSOR = torch.Tensor      # what a per-call tensor argument is (tests use stand-ins)


# ---- one launch of a plan ------------------------------------------------------------------

def kernel_params(kernel) -> list[tuple[str, bool, object]]:
    """(name, is_constexpr, default) of each parameter of a jit kernel (or a stand-in's ``fn``)."""
    k = kernel
    while not hasattr(k, "arg_names") and hasattr(k, "fn"):
        k = k.fn
    fn = k.fn if hasattr(k, "fn") else k
    out = []
    for p in inspect.signature(fn).parameters.values():
        ann = p.annotation
        const = ann is not inspect.Parameter.empty and "constexpr" in (
            ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann)))
        out.append((p.name, const, p.default))
    return out


class Launch:
    """``Launch(kernel, grid, fixed, device=..., **options)``, then ``launch(*per_call)``.
    ``fixed``: the parameters the plan fixes (an unnamed constexpr takes its default); the rest,
    in order, are per-call (ints: ``do_not_specialize``, int32). ``jit_context``: a context
    factory for the JIT calls (l2_hint's). ``guard``: the per-call tensors whose dtype and
    alignment a fast launch checks (default: all; a launcher leaves out its own buffers)."""

    __slots__ = ("kernel", "grid", "options", "device", "jit_context", "names", "fixed_values",
                 "parts", "merge", "compiled", "fast", "direct", "prefix", "dev_index", "n_call",
                 "on_gpu", "n_positional", "guard")

    def __init__(self, kernel, grid, fixed: dict, *, device: torch.device, jit_context=None,
                 guard: tuple | None = None, **options):
        grid = tuple(int(g) for g in grid)
        self.kernel = kernel
        self.grid = grid + (1,) * (3 - len(grid))
        self.options = options
        self.device = device
        self.jit_context = jit_context
        params = kernel_params(kernel)
        self.names = [name for name, _, _ in params]
        unknown = set(fixed) - set(self.names)
        if unknown:
            raise TypeError(f"{getattr(kernel, '__name__', kernel)}: no parameter {sorted(unknown)}")
        values, parts, n_call = [], [], 0
        for name, const, default in params:
            if name in fixed:
                parts.append(f"f[{len(values)}]")
                values.append(fixed[name])
            elif const:
                if default is inspect.Parameter.empty:
                    raise TypeError(f"constexpr {name} has no value and no default")
                parts.append(f"f[{len(values)}]")
                values.append(default)
            else:
                parts.append(f"a[{n_call}]")
                n_call += 1
        self.fixed_values = tuple(values)
        self.parts = parts
        self.n_call = n_call
        # positional up to the first constexpr, then by name, as a hand-written call does
        consts = [i for i, (_, const, _) in enumerate(params) if const]
        self.n_positional = consts[0] if consts else len(params)
        # the kernel's full argument tuple from (per-call args, fixed values), in its order
        self.merge = eval("lambda a, f: (" + ", ".join(parts) + ",)")   # noqa: S307
        self.compiled = self.fast = self.direct = self.prefix = None
        self.guard = guard
        self.on_gpu = device.type == "cuda"
        self.dev_index = None

    def __call__(self, *args):
        ck = self.compiled
        if ck is not None:
            full = self.fast(args, self.fixed_values)
            if (full is not None and torch._C._cuda_getDevice() == self.dev_index
                    and not _hooks_active()):
                g0, g1, g2 = self.grid
                stream = torch._C._cuda_getCurrentRawStream(self.dev_index)
                if self.direct is not None:
                    self.direct(g0, g1, g2, stream, ck.function, *self.prefix, *full)
                else:
                    ck.run(g0, g1, g2, stream, ck.function, ck.packed_metadata, None, None, None,
                           *full)
                return
        self.jit(*args)

    def jit(self, *args):
        """The launch through the JIT (and, on a GPU, the compiled kernel kept for later)."""
        if len(args) != self.n_call:
            raise TypeError(f"expected {self.n_call} per-call arguments, got {len(args)}")
        full = self.merge(args, self.fixed_values)
        k = self.n_positional
        named = dict(zip(self.names[k:], full[k:]), **self.options)
        runner = self.kernel[self.grid]
        if self.jit_context is not None:
            with self.jit_context():
                ck = runner(*full[:k], **named)
        else:
            ck = runner(*full[:k], **named)
        if (self.compiled is None and self.on_gpu and not interpreting()
                and hasattr(ck, "packed_metadata")):
            tensors = [(i, a.dtype) for i, a in enumerate(args) if isinstance(a, _TENSOR)]
            if all(args[i].data_ptr() % 16 == 0 for i, _ in tensors):
                self.fast = _fast_arguments(self.parts, tensors, self.guard)
                self.dev_index = torch.cuda.current_device()
                self.direct, self.prefix = _direct_launcher(ck)
                self.compiled = ck


def _fast_arguments(parts, tensors, guard):
    """``fast(a, f)``: the kernel's full argument tuple from the per-call arguments ``a`` and
    the fixed values ``f``, each tensor as its data pointer (the launcher then skips its
    per-pointer driver query; the ops checked devices on the host), or None when a guarded
    tensor's dtype or 16-byte alignment differs from the first call's (it then takes the JIT)."""
    env, lines = {}, ["def fast(a, f):"]
    for i, dtype in tensors:
        lines.append(f"    p{i} = a[{i}].data_ptr()")
        if guard is None or i in guard:
            env[f"D{i}"] = dtype
            lines.append(f"    if p{i} & 15 or a[{i}].dtype is not D{i}:\n        return None")
    as_pointers = {f"a[{i}]": f"p{i}" for i, _ in tensors}
    lines.append("    return (" + ", ".join(as_pointers.get(p, p) for p in parts) + ",)")
    exec("\n".join(lines), env)                 # noqa: S102  (source generated here)
    return env["fast"]


def _direct_launcher(ck):
    """(the launcher's C entry, its leading arguments) where Triton's CUDA launcher has one and
    the kernel needs no scratch buffers, else (None, None): ``ck.run`` then."""
    launcher = ck.run
    entry = getattr(launcher, "launch", None)
    if (entry is None or getattr(launcher, "global_scratch_size", 1)
            or getattr(launcher, "profile_scratch_size", 0) or not hasattr(launcher, "launch_pdl")):
        return None, None
    return entry, (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                   ck.packed_metadata, None, None, None)


def planned(table: dict, key, device: torch.device, make):
    """``table[key]``, made by ``make()`` on first use; never kept for a meta device."""
    value = table.get(key)
    if value is None:
        value = make()
        if device.type != "meta":
            table[key] = value
    return value


# ---- workspaces: buffers that live within one call -----------------------------------------

_WORKSPACES: dict = {}
WORKSPACE_MAX_BYTES = 32 << 20      # a larger buffer is allocated per call (its kernels dominate)
WORKSPACE_MAX_ENTRIES = 256


def workspace(key, device: torch.device, make):
    """``make()`` (tensors one call's launches share), kept per (``key``, device, stream) on a
    GPU or the CPU; fresh while a graph is captured, on a meta device and above the max bytes."""
    if device.type == "cuda":
        if torch._C._cuda_isCurrentStreamCapturing():
            return make()
        k = (key, device.index, stream_of(device))
    elif device.type == "cpu":
        k = (key, None, 0)
    else:
        return make()
    ws = _WORKSPACES.get(k)
    if ws is None:
        ws = make()
        if _nbytes(ws) <= WORKSPACE_MAX_BYTES:
            if len(_WORKSPACES) >= WORKSPACE_MAX_ENTRIES:
                _WORKSPACES.clear()
            _WORKSPACES[k] = ws
    return ws


def _nbytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (a tensor, None, or nested tuples of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, tuple):
        return sum(_nbytes(o) for o in obj)
    return 0


# ---- value checks: one flag word a call, read once -----------------------------------------

RING = 64                 # flag slots per (device, stream): a slot is reused 64 calls later
STAMP_LIMIT = 1 << 29     # 2 * stamp + 1 stays an int32; the ring restarts there
SPIN_S = 0.005            # how long a verdict spins on its host word before a stream sync
_RING = tl.constexpr(RING)


@triton.jit
def report_verdict(flag_ptr, host_ptr, slot, stamp, bad):
    """A check kernel's last step (``bad``: this program's 0 or 1): raise ``flags[slot]`` to
    ``2 * stamp + bad`` and take a ticket; the program with the last ticket writes the flag to
    ``host[slot]`` (pinned host memory on a GPU) and resets the ticket for the slot's next use."""
    tl.atomic_max(flag_ptr + slot, stamp * 2 + bad, sem="relaxed")
    n = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    ticket = tl.atomic_add(flag_ptr + _RING + slot, 1, sem="acq_rel")
    if ticket == n - 1:                       # every other program's flag is visible here
        tl.store(host_ptr + slot, tl.atomic_max(flag_ptr + slot, 0, sem="acquire"))
        tl.atomic_xchg(flag_ptr + _RING + slot, 0)


class _Ring:
    """Device words (RING flags, then RING tickets) and the host words the checks report to."""
    __slots__ = ("flags", "host", "words", "count", "stream")

    def __init__(self, device):
        self.flags = torch.zeros(2 * RING, dtype=torch.int32, device=device)
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(RING, dtype=torch.int32, pin_memory=on_gpu)
        self.words = self.host.numpy()
        self.count = 0
        self.stream = torch.cuda.current_stream(device) if on_gpu else None   # the ring's key


_RINGS: dict = {}


class Verdict:
    """One call's value check in flight: ``args`` (flags, host words, slot, stamp) go to the
    check kernel, which ends in :func:`report_verdict`; :meth:`failed` after the op's kernels."""
    __slots__ = ("ring", "slot", "stamp", "args")

    def __init__(self, ring, slot, stamp):
        self.ring, self.slot, self.stamp = ring, slot, stamp
        self.args = (ring.flags, ring.host, slot, stamp)

    def failed(self) -> bool:
        """Whether the check found a bad value, or did not report (the caller's full check then
        decides). Spins on the host word for up to :data:`SPIN_S`, then syncs the stream."""
        want = 2 * self.stamp
        words, slot = self.ring.words, self.slot
        got = int(words[slot])
        if got < want:
            deadline = time.perf_counter() + SPIN_S
            while got < want and time.perf_counter() < deadline:
                for _ in range(256):
                    got = int(words[slot])
                    if got >= want:
                        break
            if got < want and self.ring.stream is not None:
                self.ring.stream.synchronize()
                got = int(words[slot])
        return got != want


def value_check(device: torch.device) -> Verdict:
    """The :class:`Verdict` of one call's check on ``device``'s current stream."""
    key = (device.type, device.index, stream_of(device))
    ring = _RINGS.get(key)
    if ring is None:
        ring = _RINGS[key] = _Ring(device)
    ring.count += 1
    if ring.count >= STAMP_LIMIT:
        ring.flags.zero_()
        ring.host.zero_()
        ring.count = 1
    slot = ring.count % RING
    return Verdict(ring, slot, ring.count)
