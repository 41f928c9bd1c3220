"""One model across processes or hosts: pipeline parallelism over ``mx.distributed``.

Started by ``mlx.launch`` (``mtplx serve --distributed``), every rank loads the same
checkpoint and keeps a contiguous range of the trunk's decoder layers (``mtplx.models.stages``).
Rank 0 runs the HTTP server and the engine's step loop; the other ranks are workers that
follow it (``PipelineWorker.run``).

One forward of the batch, for ranks 0 .. n-1 on a ring:

```
rank 0     embed -> layers[0:a)  --x-->  rank 1  layers[a:b)  --x--> ... rank n-1  layers[..:L)
   ^                                                                              |
   +------------------------------- x (the last layer's output) -----------------+
rank 0     final norm -> LM head -> sampling, acceptance, MTP head (the step loop)
```

Before its activations, rank 0 sends each forward's *message* down the pipeline: the rows'
slots, committed lengths and token counts, and the KV capacity. A worker's slot store holds
its own layers' keys and values at the same slots and positions as rank 0's rows, and since
every message carries the rows' committed lengths, acceptance, rollback (``trim``) and
released rows need no messages of their own: positions past a row's length are never read
and are overwritten by later writes, on every rank alike. A verify of K + 1 tokens crosses
the pipeline once. The last rank returns the final hidden state to rank 0 (the ring's
closing hop, ``hidden_size`` values per token, the size of every other hop): the LM head,
the sampler and the MTP heads then run beside the step loop, and no vocabulary-sized
logits ever cross hosts. Each rank runs the same kernels on the same shapes as a
single-process forward, and activations cross as exact bits, so outputs are bitwise those
of one process.

Faults: a rank that dies breaks its sockets, and rank 0's next exchange raises; a rank that
hangs leaves rank 0 waiting, which a watchdog notices after ``timeout`` seconds. Either way
``on_failure`` runs once (the server fails every request with a 503 and exits non-zero).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import mlx.core as mx

from mtplx.models.quantized import activation_dtype
from mtplx.models.slot_layout import SlotRow, packed_positions
from mtplx.models.slot_target import SlotTarget

logger = logging.getLogger(__name__)

OP_FORWARD = 1
OP_STOP = 2  # rank 0, shutting down: every rank exits (the last one answers first)
OP_PING = 3  # rank 0, idle: is every rank still there? (the last one answers)
HEADER_FIELDS = 4  # op, number of rows, packed tokens, KV capacity per slot
ROW_FIELDS = 4  # slot, committed length, tokens fed, 1 if its KV has a store of its own


class PipelineLost(RuntimeError):
    """A rank of the pipeline died or stopped answering: no forward can complete."""


def check_pipeline_model(target: Any) -> None:
    """ValueError unless ``target`` is a model the pipeline splits: the llama-like trunks
    batched over slots (``SlotTarget``), the default model's family."""
    trunk = getattr(target, "trunk", None)
    if trunk is None or trunk.arch != "llama" or type(target).__name__ != "MLXTarget":
        arch = getattr(trunk, "arch", type(target).__name__)
        raise ValueError(f"--distributed splits llama-like models only, not {arch}")


def message_size(max_rows: int) -> int:
    """Fields of a forward message for a target of ``max_rows`` slots."""
    return HEADER_FIELDS + ROW_FIELDS * max_rows


def encode_message(
    op: int, rows: Sequence[SlotRow], counts: Sequence[int], capacity: int, max_rows: int
) -> mx.array:
    """A forward's message: [op, R, N, capacity, (slot, length, count, private) x R, 0 ...]
    int32."""
    fields = [op, len(rows), sum(counts), capacity]
    for row, count in zip(rows, counts, strict=True):
        fields += [row.slot, row.length, count, int(row.private)]
    fields += [0] * (message_size(max_rows) - len(fields))
    return mx.array(fields, mx.int32)


class PipelineTarget(SlotTarget):
    """Rank 0's batched target: embedding, its own stage of layers, the final norm and the
    LM head; the other stages run on the workers (see the module docstring)."""

    trims_lazily = False  # the workers get each row's length as a number in every message

    def __init__(
        self,
        target: Any,
        group: mx.distributed.Group,
        max_rows: int = 16,
        *,
        timeout: float = 20.0,
        on_failure: Callable[[PipelineLost], None] | None = None,
    ) -> None:
        check_pipeline_model(target)
        super().__init__(target, max_rows, keep_hidden=False)
        if group.rank() != 0 or group.size() < 2:
            raise ValueError("PipelineTarget runs on rank 0 of a group of two or more ranks")
        self.group = group
        self.timeout = timeout
        self.on_failure = on_failure
        self.calibration_key: str | None = f"pipeline of {group.size()} ranks"
        # An idle pipeline is pinged this often, so a rank lost between requests is noticed
        # then, not by the next request.
        self.heartbeat = timeout / 4
        self._failure: PipelineLost | None = None
        self._waiting_since: float | None = None
        self._last_exchange = time.monotonic()
        self._lock = threading.Lock()  # the fields above
        self._exchanging = threading.Lock()  # one exchange at a time: forwards and pings
        for name, loop in (("watchdog", self._watch), ("heartbeat", self._beat)):
            threading.Thread(target=loop, name=f"mtplx-pipeline-{name}", daemon=True).start()

    @property
    def failure(self) -> PipelineLost | None:
        """Why the pipeline stopped working (None while it works)."""
        return self._failure

    saves_blocks = False  # blocks would hold rank 0's layers only: no prefix cache

    def _trunk_layers(
        self,
        x: mx.array,
        rows: list[SlotRow],
        counts: list[int],
        groups: list[Any],
        positions: mx.array,
    ) -> mx.array:
        """Rank 0's layers, then the other stages': x [1, N, H] -> the last layer's [1, N, H],
        evaluated (the exchange is where a lost rank shows)."""
        if self._failure is not None:
            raise self._failure
        message = encode_message(OP_FORWARD, rows, counts, self._shared.capacity, self.max_rows)
        x = self._layers(x, groups, positions)
        with self._exchanging:
            sent = mx.distributed.send(message, 1, group=self.group)
            sent_x = mx.distributed.send(mx.depends(x, sent), 1, group=self.group)
            back = mx.distributed.recv_like(x, self.group.size() - 1, group=self.group)
            back = mx.depends(back, sent_x)
            self._exchange(back)
        return back

    def close(self) -> bool:
        """Tell the workers to exit (a normal shutdown). False when the pipeline had been
        lost or is lost now (nothing reached the workers)."""
        with self._exchanging:
            if self._failure is None:
                # Around the ring and back, like a ping: a rank that died since the last
                # exchange (mlx.launch then SIGTERMs this one at once, before any heartbeat
                # notices) is a failure, not a normal stop.
                with contextlib.suppress(PipelineLost):  # reported through on_failure
                    self._round_trip(OP_STOP)
            with self._lock:
                closed = self._failure is None
                self._failure = self._failure or PipelineLost("the pipeline was closed")
        return closed

    def _ping(self) -> None:
        """A message around the ring and back (the caller holds ``_exchanging``)."""
        self._round_trip(OP_PING)

    def _round_trip(self, op: int) -> None:
        """Send ``op`` around the ring; the last rank sends it back (under the watchdog)."""
        message = encode_message(op, [], [], 0, self.max_rows)
        sent = mx.distributed.send(message, 1, group=self.group)
        back = mx.distributed.recv_like(message, self.group.size() - 1, group=self.group)
        self._exchange(mx.depends(back, sent))

    def _exchange(self, array: mx.array) -> None:
        """Evaluate ``array`` (which waits on other ranks) under the watchdog."""
        with self._lock:
            self._waiting_since = time.monotonic()
        try:
            mx.eval(array)
        except RuntimeError as exc:  # the ring backend: "connection to a peer was lost"
            self._fail(PipelineLost(f"a pipeline rank was lost: {exc}"))
            assert self._failure is not None
            raise self._failure from exc
        finally:
            with self._lock:
                self._waiting_since = None
                self._last_exchange = time.monotonic()

    def _beat(self) -> None:
        """Ping the ranks when nothing else has crossed the pipeline for a while."""
        while self._failure is None:
            time.sleep(self.heartbeat)
            with self._lock:
                quiet = time.monotonic() - self._last_exchange >= self.heartbeat
            if quiet and self._failure is None and self._exchanging.acquire(blocking=False):
                try:
                    if self._failure is None:
                        self._ping()
                except PipelineLost:
                    return
                finally:
                    self._exchanging.release()

    def _watch(self) -> None:
        """Fail the pipeline when an exchange waits longer than ``timeout``."""
        while self._failure is None:
            time.sleep(min(self.timeout / 4, 1.0))
            with self._lock:
                since = self._waiting_since
            if since is not None and time.monotonic() - since > self.timeout:
                self._fail(
                    PipelineLost(
                        f"a pipeline rank has not answered for {self.timeout:g} s "
                        "(hung or unreachable)"
                    )
                )

    def _fail(self, failure: PipelineLost) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = failure
        logger.error("%s", failure)
        if self.on_failure is not None:
            self.on_failure(failure)


class PipelineWorker(SlotTarget):
    """A worker rank's stage: runs its layers for every forward rank 0 sends, until told to
    stop (see the module docstring)."""

    def __init__(self, target: Any, group: mx.distributed.Group, max_rows: int = 16) -> None:
        check_pipeline_model(target)
        super().__init__(target, max_rows, keep_hidden=False)
        if group.rank() == 0:
            raise ValueError("rank 0 runs the step loop, not a worker")
        self.group = group
        self.num_forwards = 0

    def run(self) -> None:
        """Serve forwards until rank 0 says stop. A lost peer raises RuntimeError."""
        rank, size = self.group.rank(), self.group.size()
        previous, following = rank - 1, (rank + 1) % size
        template = mx.zeros((message_size(self.max_rows),), mx.int32)
        dtype = activation_dtype(self.trunk.inner)  # float32 for a quantized embedding
        while True:
            message = mx.distributed.recv_like(template, previous, group=self.group)
            if rank < size - 1:  # pass it on first: the next stage prepares while we compute
                message = mx.distributed.send(message, following, group=self.group)
            fields = message.tolist()
            if fields[0] in (OP_STOP, OP_PING):
                if rank == size - 1:  # the ring's closing hop: rank 0 waits for it
                    mx.eval(mx.distributed.send(message, 0, group=self.group))
                if fields[0] == OP_STOP:
                    return
                continue
            if fields[0] != OP_FORWARD:
                raise RuntimeError(f"unknown pipeline message {fields[:HEADER_FIELDS]}")
            _, num_rows, num_tokens, capacity = fields[:HEADER_FIELDS]
            rows, counts = self._mirror_rows(fields, num_rows)
            x = mx.distributed.recv_like(
                mx.zeros((1, num_tokens, self.hidden_size), dtype), previous, group=self.group
            )
            self._ensure_capacity(capacity)
            groups = self._groups(rows, counts)
            x = self._layers(x, groups, packed_positions(rows, counts))
            mx.eval(mx.distributed.send(x, following, group=self.group))
            self.num_forwards += 1

    def _mirror_rows(self, fields: list[int], num_rows: int) -> tuple[list[SlotRow], list[int]]:
        """Rows at rank 0's slots and lengths, in the message's order (rank 0's packing)."""
        rows, counts = [], []
        self._live = {}
        for index in range(num_rows):
            slot, length, count, private = fields[HEADER_FIELDS + ROW_FIELDS * index :][:ROW_FIELDS]
            row = SlotRow(slot, length, private=bool(private))
            self._live[slot] = row
            rows.append(row)
            counts.append(count)
        return rows, counts


# Seconds rank 0 lets the 503s of a lost pipeline reach their clients before it exits.
EXIT_GRACE_SECONDS = 1.5
# Seconds a failing rank lets mlx.launch pass its last output on before terminating it.
RELAY_SECONDS = 0.5


class Pipeline:
    """This process's place in a pipeline started by ``mlx.launch`` (``mtplx serve
    --distributed``): rank 0 builds the engine's ``PipelineTarget``, the other ranks
    ``work``."""

    def __init__(self, group: mx.distributed.Group, timeout: float = 20.0) -> None:
        if group.size() < 2:
            raise ValueError(
                "needs two or more ranks: start it with mlx.launch, e.g. "
                "mlx.launch --backend ring -n 2 mtplx serve --distributed"
            )
        if timeout <= 0:
            raise ValueError(f"the pipeline timeout must be > 0, got {timeout:g}")
        self.group = group
        self.timeout = timeout
        # Rank 0: called once when a rank is lost (the server fails its requests); the
        # process then exits with status 1.
        self.on_failure: Callable[[PipelineLost], None] | None = None
        self._target: PipelineTarget | None = None

    @classmethod
    def join(cls, timeout: float = 20.0) -> Pipeline:
        """Join the group ``mlx.launch`` set up (RuntimeError outside one)."""
        return cls(mx.distributed.init(strict=True), timeout)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def stage(self) -> tuple[int, int]:
        """(rank, number of ranks): what ``mtplx.models.load`` keeps."""
        return self.group.rank(), self.group.size()

    def target(self, target: Any, max_rows: int) -> PipelineTarget:
        """Rank 0's batched target over the loaded stage ``target``."""
        self._target = PipelineTarget(
            target, self.group, max_rows, timeout=self.timeout, on_failure=self._lost
        )
        return self._target

    def work(self, model: str, max_rows: int) -> int:
        """A worker rank: load this stage of ``model`` and serve rank 0's forwards until it
        stops (0) or is lost (1)."""
        from mtplx.models import load

        try:
            loaded = load(model, stage=self.stage)
            worker = PipelineWorker(loaded.target, self.group, max_rows)
        except Exception as exc:  # a bad checkpoint, a model the pipeline cannot split
            logger.error("rank %d: the model failed to load: %s", self.rank, exc)
            _end_launcher()  # mlx.launch would exit 0
            return 1
        logger.info("rank %d of %d ready", self.rank, self.group.size())
        try:
            worker.run()
        except RuntimeError as exc:
            logger.error("rank %d: the pipeline was lost: %s", self.rank, exc)
            return 1
        logger.info("rank %d stopped after %d forwards", self.rank, worker.num_forwards)
        return 0

    @property
    def failure(self) -> PipelineLost | None:
        """Rank 0: why the pipeline was lost, or None."""
        return None if self._target is None else self._target.failure

    def close(self) -> bool:
        """Rank 0 at shutdown: stop the workers. False when the pipeline had been lost
        (the server should exit non-zero)."""
        return self._target is None or self._target.close()

    def exit_lost(self) -> NoReturn:
        """Rank 0 after a lost rank: exit with status 1 now (the engine thread may be blocked
        in a receive that never returns). ``mlx.launch`` exits 0 whatever its ranks did, and
        waits forever on a stopped rank: a local one is terminated as well, so whoever
        started it sees the failure (status 143). Its other ranks on this host are killed
        first: a stopped one would outlive mlx.launch (the others end as their sockets
        close)."""
        _end_launcher(kill_ranks=True)
        os._exit(1)

    def _lost(self, failure: PipelineLost) -> None:
        if self.on_failure is not None:
            self.on_failure(failure)
        threading.Timer(EXIT_GRACE_SECONDS, self.exit_lost).start()


def _end_launcher(kill_ranks: bool = False) -> None:
    """Terminate the local ``mlx.launch`` that started this rank, if any (it exits 0
    whatever its ranks did, so the command it ran then fails with status 143);
    ``kill_ranks``: kill its other ranks first."""
    launcher = _launcher_pid()
    if launcher is None:
        return
    logger.error("terminating mlx.launch (pid %d): the pipeline cannot run", launcher)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    time.sleep(RELAY_SECONDS)  # mlx.launch relays what this rank wrote before it goes
    for rank in _children(launcher) - {os.getpid()} if kill_ranks else ():
        with contextlib.suppress(OSError):
            os.kill(rank, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.kill(launcher, signal.SIGTERM)


def _launcher_pid() -> int | None:
    """The parent process when it is ``mlx.launch`` (a rank it started on this host)."""
    parent = os.getppid()
    try:
        command = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:  # no /proc (macOS)
        result = subprocess.run(
            ["ps", "-o", "args=", "-p", str(parent)], capture_output=True, text=True, check=False
        )
        command = result.stdout
    launcher = "mlx.launch" in command or "mlx._distributed_utils.launch" in command
    return parent if launcher and parent > 1 else None


def _children(parent: int) -> set[int]:
    """The processes whose parent is ``parent``."""
    proc = Path("/proc")
    if proc.is_dir():
        children = set()
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                # pid (comm) state ppid ...: comm may hold spaces and parentheses.
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    children.add(int(entry.name))
        return children
    result = subprocess.run(  # macOS
        ["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, check=False
    )
    pairs = (line.split() for line in result.stdout.splitlines())
    return {int(pid) for pid, ppid in pairs if int(ppid) == parent}
