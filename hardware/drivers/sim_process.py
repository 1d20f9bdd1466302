"""A MuJoCo simulation stepped in real time in a process of its own, like hardware with its own clock and CPU.

Why a process: a simulation on a thread of the control process shares its GIL, so a camera
render or a slow Python step can hold a 500 Hz control tick for milliseconds. A real robot has
its own clock and CPU; here the simulation gets its own interpreter, and the control loop only
copies the latest published snapshot and leaves its command in a slot, never waiting for a step.

The child is started with the multiprocessing "spawn" context (forking a process that has used
EGL/GL can hang) and builds the simulation from a picklable description: ``program_cls`` (an
importable class, see :class:`SimProgram`) and its keyword arguments. Everything after that goes
through ONE shared memory block whose layout the parent fixes before spawning; nothing is pickled
per tick and no pipe is on the hot path. Each area starts on a 64-byte boundary::

    header   16 int64 slots (_SEQ .. _ERROR_LEN below): snapshot seqlock counter, snapshot time
             (a float64), image and info versions, info length, command seqlock counter and
             "command present" flag, run flag, step and late-step counters, error flag and length
    state    float64[state_dim]          child → parent, every step
    command  float64[command_dim]        parent → child, read by the child before each step
    images   uint8[H, W, 3] per camera   child → parent, when the program rendered
    info     uint8[info_capacity]        child → parent: a small dict as UTF-8 JSON
    error    uint8[error_capacity]       child → parent: repr() of the exception that ended it

Snapshots are published under a seqlock: the writer makes the counter odd, writes the fields and
makes it even again; the reader reads the counter, copies, and re-reads it, retrying while it is
odd or has changed (it backs off with short sleeps, since a writer preempted mid-publish can only
finish if the reader lets it run, and gives up with a DriverError after a bounded number of
tries). Images and info carry their own version counters, so a reader copies the images and
parses the JSON only when they changed; the state (a few floats) is copied on every read. The
command slot is the same scheme in the other direction (the child keeps its previous command
while the parent is mid-write). Snapshot times are ``time.monotonic()`` of the child:
CLOCK_MONOTONIC is system-wide on Linux, so the parent can age them with its own clock. The
protocol relies on x86-64 keeping numpy's plain stores (and loads) in program order; see
:func:`_publish`.

Lifecycle: :meth:`RealtimeSimProcess.close` clears the run flag, joins the child (terminating,
then killing it if it does not exit) and closes and unlinks the block, which a failed start
does too. An exception in the child (setup or step) is written into the block (error flag and
its repr) before the child exits with code 1, its traceback on stderr; a child that died
without a word (killed) is reported with its exit code, and one that stops publishing as
stalled. Spawning re-imports the parent's main module in the child, so a script that starts a
simulation needs the usual ``if __name__ == "__main__":`` guard.

The block is created and unlinked by the parent. A spawned child shares the parent's
multiprocessing resource tracker (its fd is passed on), where a name is kept in a set: the
child's attach registers the name a second time (a no-op) and must NOT unregister it, or the
parent's own unregister at unlink would fail in the tracker (a KeyError traceback at exit) and a
crashed parent would leak the block. If the parent dies, the child notices (``os.getppid()``)
and exits, and the tracker, left with no users, unlinks the block.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any, Protocol

import numpy as np

from hardware.drivers.base import DriverError

# Header slots, int64 each (_T holds a float64).
_SEQ, _T, _IMAGES_VERSION, _INFO_VERSION, _INFO_LEN = 0, 1, 2, 3, 4
_CMD_SEQ, _CMD_PRESENT = 5, 6
_RUN, _STEPS, _LATE_STEPS = 7, 8, 9
_ERROR, _ERROR_LEN = 10, 11
_HEADER_SLOTS = 16
_ALIGN = 64

_READ_TRIES = 200  # seqlock reads before latest() gives up (about 10-20 ms with the back-off)
_READ_SPINS = 3  # tries before backing off
_READ_BACKOFF = 50e-6  # seconds slept between later tries
_COMMAND_TRIES = 3  # the child's tries at the command slot before it keeps its previous command
_EXIT_CHECK_PERIOD = 0.005  # latest() asks the OS whether the child is alive at most this often


@dataclass
class SimSnapshot:
    """What the simulated robot last reported (``t``: time.monotonic() when it was taken)."""

    t: float
    state: np.ndarray
    images: dict[str, np.ndarray] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class SimProgram(Protocol):
    """The simulation run in the child, constructed there as ``program_cls(**program_kwargs)``."""

    def setup(self) -> dict[str, Any]:
        """Build the simulation, GL renderers included (a GL context belongs to the process that
        creates it); returns the initial info (published with the first step)."""
        ...

    def step(self, command: np.ndarray | None
             ) -> tuple[np.ndarray, dict[str, np.ndarray] | None, dict[str, Any] | None]:
        """Advance one period with the latest command (None: none written yet, or cleared).

        Returns ``(state, images, info)``: the state vector; an image for every camera of the
        layout, or None when unchanged; the info dict (replaces the previous one; must be
        JSON-serializable, numpy scalars and arrays are converted), or None when unchanged.
        """
        ...

    def teardown(self) -> None: ...


@dataclass(frozen=True)
class _Layout:
    """Sizes of the shared block's areas, fixed by the parent before the child starts."""

    state_dim: int
    command_dim: int
    cameras: tuple[tuple[str, tuple[int, int, int]], ...]
    info_capacity: int
    error_capacity: int = 4096

    def regions(self) -> tuple[list[tuple[str, int, tuple[int, ...], type]], int]:
        """``(area, byte offset, shape, dtype)`` in block order (images as ``image:<camera>``) and the block size."""
        areas = [("header", (_HEADER_SLOTS,), np.int64), ("state", (self.state_dim,), np.float64),
                 ("command", (self.command_dim,), np.float64)]
        areas += [(f"image:{name}", tuple(shape), np.uint8) for name, shape in self.cameras]
        areas += [("info", (self.info_capacity,), np.uint8), ("error", (self.error_capacity,), np.uint8)]
        out, offset = [], 0
        for area, shape, dtype in areas:
            out.append((area, offset, shape, dtype))
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            offset += -(-nbytes // _ALIGN) * _ALIGN
        return out, offset


class _Views:
    """numpy views of the block's areas. Every one must be dropped before the block is closed."""

    def __init__(self, buf, layout: _Layout):
        regions, _ = layout.regions()
        arrays = {area: np.ndarray(shape, dtype, buffer=buf, offset=offset) for area, offset, shape, dtype in regions}
        self.header: np.ndarray = arrays["header"]
        self.t: np.ndarray = self.header[_T:_T + 1].view(np.float64)
        self.state: np.ndarray = arrays["state"]
        self.command: np.ndarray = arrays["command"]
        self.images: dict[str, np.ndarray] = {name: arrays[f"image:{name}"] for name, _ in layout.cameras}
        self.info: np.ndarray = arrays["info"]
        self.error: np.ndarray = arrays["error"]

    def failure(self) -> str | None:
        """The child's error message, when it wrote one."""
        if not self.header[_ERROR]:
            return None
        return bytes(self.error[: int(self.header[_ERROR_LEN])]).decode("utf-8", "replace")


# -- the child ------------------------------------------------------------------------------
def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _publish(v: _Views, t: float, state, images: dict[str, np.ndarray] | None, info: dict[str, Any] | None) -> None:
    """Seqlock writer. Everything is checked before the counter turns odd, so a bad value never
    leaves it odd. On x86-64 numpy's plain stores reach the reader in program order (TSO, and
    each store is a separate call the C compiler cannot move across); the 8-byte aligned counter
    stores are atomic. A weakly ordered CPU (ARM) would need fences here, which numpy lacks."""
    state = np.asarray(state, dtype=np.float64)
    if state.shape != v.state.shape:
        raise ValueError(f"program state has shape {state.shape}, the layout says {v.state.shape}")
    if images is not None:
        if images.keys() != v.images.keys():
            raise ValueError(f"program images {sorted(images)} != layout cameras {sorted(v.images)}")
        for name, img in images.items():
            if img.shape != v.images[name].shape or img.dtype != np.uint8:
                raise ValueError(f"image {name!r}: {img.dtype} {img.shape}, "
                                 f"the layout says uint8 {v.images[name].shape}")
    data = None if info is None else json.dumps(info, default=_json_default).encode()
    if data is not None and len(data) > len(v.info):
        raise ValueError(f"info is {len(data)} bytes of JSON, more than the {len(v.info)} bytes reserved")
    hdr = v.header
    seq = int(hdr[_SEQ])
    hdr[_SEQ] = seq + 1
    v.state[:] = state
    v.t[0] = t
    if images is not None:
        for name, img in images.items():
            v.images[name][...] = img
        hdr[_IMAGES_VERSION] += 1
    if data is not None:
        v.info[: len(data)] = np.frombuffer(data, np.uint8)
        hdr[_INFO_LEN] = len(data)
        hdr[_INFO_VERSION] += 1
    hdr[_SEQ] = seq + 2


def _read_command(v: _Views, previous: np.ndarray | None) -> np.ndarray | None:
    """Seqlock reader of the parent's command slot; the previous command while the parent is mid-write."""
    hdr = v.header
    for _ in range(_COMMAND_TRIES):
        seq = int(hdr[_CMD_SEQ])
        if seq & 1:
            continue
        present, command = bool(hdr[_CMD_PRESENT]), v.command.copy()
        if int(hdr[_CMD_SEQ]) == seq:
            return command if present else None
    return previous


def _serve(buf, layout: _Layout, program_cls, program_kwargs: dict[str, Any], period: float,
           fifo_priority: int | None, parent_pid: int) -> str | None:
    """Set up the program and step it in real time until the run flag clears or the parent is
    gone. Returns None, or the traceback of the exception that ended it (its repr is in the block)."""
    v = _Views(buf, layout)
    hdr = v.header
    program = None
    try:
        if fifo_priority is not None:
            # Below the control loop's priority but above ordinary processes, like a servo
            # controller; the sleep below keeps it from starving its core.
            try:
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(fifo_priority))
            except (OSError, AttributeError):
                pass
        program = program_cls(**program_kwargs)
        pending_info = program.setup()
        command = None
        next_t = time.monotonic()
        while hdr[_RUN] and os.getppid() == parent_pid:
            command = _read_command(v, command)
            state, images, info = program.step(command)
            _publish(v, time.monotonic(), state, images, pending_info if info is None else info)
            pending_info = None
            hdr[_STEPS] += 1
            next_t += period
            delay = next_t - time.monotonic()
            if delay < -period:  # fell behind by a whole step: count it, do not catch up
                hdr[_LATE_STEPS] += 1
                next_t = time.monotonic()
            # Always give up the core for part of a period: at FIFO priority a simulation that
            # cannot keep real time would otherwise spin and starve every ordinary process on
            # its core (the policy worker among them).
            time.sleep(max(delay, 0.25 * period))
        return None
    except BaseException as exc:  # reported through the block to the parent's latest()
        text = repr(exc).encode("utf-8", "replace")[: len(v.error)]
        v.error[: len(text)] = np.frombuffer(text, np.uint8)
        hdr[_ERROR_LEN] = len(text)
        hdr[_ERROR] = 1
        return traceback.format_exc()
    finally:
        if program is not None:
            try:
                program.teardown()
            except Exception:
                pass


def _child_main(shm_name: str, layout: _Layout, program_cls, program_kwargs: dict[str, Any], period: float,
                fifo_priority: int | None, parent_pid: int) -> None:
    """Entry point of the simulation process."""
    # Ctrl-C reaches the whole process group; the parent decides when the simulation ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    shm = shared_memory.SharedMemory(name=shm_name)  # no resource_tracker.unregister: see the module docstring
    try:
        failure = _serve(shm.buf, layout, program_cls, program_kwargs, period, fifo_priority, parent_pid)
    finally:
        shm.close()
    if failure is not None:
        sys.stderr.write(f"simulation process {multiprocessing.current_process().name}: {failure}")
        sys.exit(1)


# -- the parent -----------------------------------------------------------------------------
class RealtimeSimProcess:
    """Runs ``program_cls(**program_kwargs).step(command)`` every ``period`` seconds of wall time
    in a child process, publishing :class:`SimSnapshot` s through shared memory.

    ``state_dim``, ``command_dim``, ``cameras`` (``{name: (H, W, 3)}``) and ``info_capacity``
    (bytes of JSON) fix the shared block's layout. If the program raises, :meth:`latest` raises
    with its message; if the child dies without one (e.g. killed), with its exit code; if it
    stops publishing for ``stale_after`` seconds (a hang), with "simulation stalled" — so the
    node sees a driver that stopped answering. :meth:`latest` and :meth:`set_command` only touch
    the shared block (microseconds) and may be called from any thread.
    """

    def __init__(self, name: str, period: float, program_cls: type[SimProgram],
                 program_kwargs: dict[str, Any] | None = None, *, state_dim: int, command_dim: int,
                 cameras: dict[str, tuple[int, int, int]] | None = None, info_capacity: int = 64 * 1024,
                 stale_after: float = 0.5, fifo_priority: int | None = 40):
        self.name, self.period, self.stale_after = name, float(period), float(stale_after)
        self.program_cls, self.program_kwargs = program_cls, dict(program_kwargs or {})
        self.fifo_priority = fifo_priority
        cams = tuple((str(n), tuple(int(s) for s in shape)) for n, shape in (cameras or {}).items())
        for n, shape in cams:
            if len(shape) != 3 or shape[2] != 3 or min(shape) < 1:
                raise ValueError(f"camera {n!r}: shape must be (H, W, 3), got {shape}")
        self._layout = _Layout(int(state_dim), int(command_dim), cams, int(info_capacity))
        self.shm_name: str | None = None  # the block's name (/dev/shm/<name> on Linux); kept after close
        self._shm: shared_memory.SharedMemory | None = None
        self._views: _Views | None = None
        self._process = None
        self._command_lock = threading.Lock()
        self._final_counts = (0, 0)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def steps(self) -> int:
        v = self._views
        return int(v.header[_STEPS]) if v is not None else self._final_counts[0]

    @property
    def late_steps(self) -> int:
        v = self._views
        return int(v.header[_LATE_STEPS]) if v is not None else self._final_counts[1]

    def start(self, timeout: float = 30.0) -> None:
        """Create the block, spawn the child and wait for its first step; cleans up if that fails."""
        if self._shm is not None:
            raise DriverError(f"{self.name}: already started")
        _, size = self._layout.regions()
        self._images: tuple[int, dict[str, np.ndarray]] = (0, {})  # (version, copies): swapped whole
        self._info: tuple[int, dict[str, Any]] = (0, {})
        self._next_exit_check = 0.0
        self._shm = shared_memory.SharedMemory(create=True, size=size)  # zero-filled
        self.shm_name = self._shm.name
        try:
            self._views = _Views(self._shm.buf, self._layout)
            self._views.header[_RUN] = 1
            self._process = multiprocessing.get_context("spawn").Process(
                target=_child_main, name=self.name, daemon=True,
                args=(self._shm.name, self._layout, self.program_cls, self.program_kwargs, self.period,
                      self.fifo_priority, os.getpid()))
            self._process.start()
            self._wait_first_step(timeout)
        except BaseException:
            self.close()
            raise

    def _wait_first_step(self, timeout: float) -> None:
        v, deadline = self._views, time.monotonic() + timeout
        while not v.header[_STEPS]:
            failure = v.failure()
            if failure is not None:
                raise DriverError(f"{self.name}: simulation failed to start: {failure}")
            if self._process.exitcode is not None:
                raise DriverError(f"{self.name}: simulation process exited with code {self._process.exitcode} "
                                  "before its first step")
            if time.monotonic() > deadline:
                raise DriverError(f"{self.name}: simulation did not start within {timeout:.0f}s")
            time.sleep(0.005)

    def set_command(self, command: np.ndarray | None) -> None:
        """Leave ``command`` (or None: no command) for the child's next step."""
        if command is not None:
            command = np.asarray(command, dtype=np.float64)
            expected = (self._layout.command_dim,)
            if command.shape != expected:
                raise DriverError(f"{self.name}: command shape {command.shape}, expected {expected}")
        with self._command_lock:  # one writer at a time (control loop, watchdog's stop())
            v = self._views
            if v is None:
                raise DriverError(f"{self.name}: not started")
            hdr = v.header
            seq = int(hdr[_CMD_SEQ])
            hdr[_CMD_SEQ] = seq + 1
            if command is None:
                hdr[_CMD_PRESENT] = 0
            else:
                v.command[:] = command
                hdr[_CMD_PRESENT] = 1
            hdr[_CMD_SEQ] = seq + 2

    def latest(self) -> SimSnapshot:
        """The last published snapshot (copies: the caller may keep them)."""
        v = self._views
        if v is None:
            raise DriverError(f"{self.name}: not started")
        failure = v.failure()
        if failure is not None:
            raise DriverError(f"{self.name}: simulation process failed: {failure}")
        now = time.monotonic()
        if now >= self._next_exit_check:
            self._next_exit_check = now + _EXIT_CHECK_PERIOD
            code = self._process.exitcode
            if code is not None:  # it may have written its error just before exiting
                failure = v.failure()
                raise DriverError(f"{self.name}: simulation process failed: {failure}" if failure is not None
                                  else f"{self.name}: simulation process exited with code {code}")
        snap = self._read(v)
        if snap is None:
            raise DriverError(f"{self.name}: not started")
        age = time.monotonic() - snap.t
        if age > self.stale_after:
            raise DriverError(f"{self.name}: no state for {age:.2f}s (simulation stalled)")
        return snap

    def _read(self, v: _Views) -> SimSnapshot | None:
        """Seqlock reader (None before the first publication)."""
        hdr = v.header
        images_cached, info_cached = self._images, self._info
        for attempt in range(_READ_TRIES):
            if attempt >= _READ_SPINS:
                time.sleep(_READ_BACKOFF)
            seq = int(hdr[_SEQ])
            if seq == 0:
                return None
            if seq & 1:
                continue
            t, state = float(v.t[0]), v.state.copy()
            images_version, info_version = int(hdr[_IMAGES_VERSION]), int(hdr[_INFO_VERSION])
            images = (images_cached[1] if images_version == images_cached[0]
                      else {name: img.copy() for name, img in v.images.items()})
            raw = None if info_version == info_cached[0] else bytes(v.info[: int(hdr[_INFO_LEN])])
            if int(hdr[_SEQ]) != seq:
                continue
            if images_version != images_cached[0]:
                self._images = (images_version, images)
            info = info_cached[1]
            if raw is not None:
                info = json.loads(raw)
                self._info = (info_version, info)
            return SimSnapshot(t, state, images, info)
        raise DriverError(f"{self.name}: no consistent snapshot in {_READ_TRIES} tries "
                          "(the simulation process is stuck inside a publish)")

    def close(self, timeout: float = 2.0) -> None:
        """Clear the run flag and join the child (then terminate, then kill it); free the block."""
        with self._command_lock:
            v, self._views = self._views, None
        if v is not None:
            v.header[_RUN] = 0
            self._final_counts = (int(v.header[_STEPS]), int(v.header[_LATE_STEPS]))
            del v  # the block cannot close while a view of it exists
        process, self._process = self._process, None
        if process is not None and process.pid is not None:
            process.join(timeout)
            if process.exitcode is None:
                process.terminate()
                process.join(1.0)
            if process.exitcode is None:
                process.kill()
                process.join(1.0)
            if process.exitcode is not None:
                process.close()
        shm, self._shm = self._shm, None
        if shm is not None:
            try:
                shm.close()
            finally:
                shm.unlink()
