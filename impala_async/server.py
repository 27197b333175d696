"""The learner server: asyncio (uvloop) for sockets, one thread for training.

Life: startup (bind sockets, start the training thread, start local actors) -> main loop (receive, publish, report,
supervise) -> graceful shutdown (stop intake, stop training, final checkpoint, stop actors, close sockets) -> forced
shutdown if that takes longer than ``shutdown_timeout_s`` or a second Ctrl-C arrives.

Threads: the event loop owns every socket. The training thread owns the model and optimizer; it takes full batches
from the ring, trains, and hands encoded weights back to the loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import zmq
import zmq.asyncio

from . import checkpoint, wire
from .config import LearnerConfig
from .learn import RHO_BIN_EDGES, Learner
from .metrics import MetricsWriter, Progress
from .procs import ActorProcesses
from .ring import TrajectoryRing
from .spec import TrajectorySpec

log = logging.getLogger("impala_async.server")

MAX_DRAIN_MESSAGES = 256  # messages handled per wake-up before yielding to other tasks
MAX_DRAIN_S = 0.005  # ... or this much time


class LearnerServer:
    def __init__(self, cfg: LearnerConfig, learner: Learner, spec: TrajectorySpec, run_info: dict, logdir: Path,
                 *, start_monotonic: float, actors: ActorProcesses | None = None, resumed: dict | None = None):
        self.cfg, self.learner, self.spec, self.run_info = cfg, learner, spec, run_info
        self.logdir = Path(logdir)
        self.device = learner.device
        self.actors = actors
        self.t0 = start_monotonic
        self.ring = TrajectoryRing(spec, cfg.batch_size, cfg.ring_batches, pin_memory=self.device.type == "cuda",
                                   drop_when_full=cfg.when_full == "drop_oldest")
        self.decoder = wire.TrajectoryDecoder(spec, wire.WireLimits(
            max_message_bytes=cfg.max_message_bytes, max_trajectories_per_message=cfg.max_trajectories_per_message,
            max_episodes_per_message=cfg.max_episodes_per_message, max_actor_id_bytes=cfg.max_actor_id_bytes))
        self.steps_per_trajectory = spec.unroll_length
        # Counters (event-loop thread unless noted).
        self.policy_version = 0  # written by the training thread
        self.env_steps = 0  # steps in accepted trajectories
        self.trajectories_received = 0
        self.messages_received = 0
        self.bytes_received = 0
        self.rejected = collections.Counter()
        self.dropped_stale_arrival = 0
        self.episodes = 0
        self.returns: collections.deque = collections.deque(maxlen=100)
        self.lengths: collections.deque = collections.deque(maxlen=100)
        self.wall_offset_s = 0.0
        if resumed:
            self._restore_counters(resumed)
        self._prev_report = (start_monotonic, self.env_steps)  # (time, env_steps) of the last metrics line
        self._last_seq: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._pending: tuple[wire.TrajectoryMessage, int, int] | None = None  # (message, next index, arrival ns)
        self._last_data_at = time.monotonic()
        self._first_data_at: float | None = None
        # Shared with the training thread.
        self._stats_lock = threading.Lock()
        self._stats: list[dict] = []
        self._lags: list[tuple[int, float, int]] = []
        self._train_stop = threading.Event()
        self._trainer_error: BaseException | None = None
        self._weights: bytes | None = None
        self.exit_code = 0
        self.exit_reason = ""

    # ------------------------------------------------------------------------------------------------- lifecycle
    async def serve(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._room = asyncio.Event()
        self.ring.on_release = lambda: self._loop.call_soon_threadsafe(self._room.set)
        self._signals = 0
        self._startup()
        try:
            await self._main()
        finally:
            await self._shutdown()
        return self.exit_code

    def _startup(self) -> None:
        cfg = self.cfg
        self.ctx = zmq.asyncio.Context(1)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, cfg.receive_hwm_messages)
        self.pull.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(cfg.listen)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 2)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(cfg.publish)
        self.listen_endpoint = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self.publish_endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pull_sync = zmq.Socket.shadow(self.pull.underlying)  # drains without a Future per message
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(sig, self._on_signal, sig)
        self.metrics = MetricsWriter(self.logdir / "metrics.jsonl")
        self.progress = Progress()
        self._publish_now()
        self._trainer = threading.Thread(target=self._train_loop, name="trainer", daemon=True)
        self._trainer.start()
        log.info("learner: trajectories in on %s, weights out on %s, logdir %s, device %s",
                 self.listen_endpoint, self.publish_endpoint, self.logdir, self.device)
        print(f"impala-async learner listening: --learner {self.listen_endpoint} --weights {self.publish_endpoint}",
              flush=True)
        if self.actors is not None:
            self.actors.start()

    async def _main(self) -> None:
        tasks = [asyncio.create_task(c) for c in
                 (self._receive_loop(), self._republish_loop(), self._report_loop(), self._watch_loop())]
        stop = asyncio.create_task(self._stop.wait())
        done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not stop and t.exception() is not None:
                log.error("learner task failed", exc_info=t.exception())
                self.request_stop(f"internal error: {t.exception()!r}", 1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stop.cancel()

    def request_stop(self, reason: str, code: int = 0) -> None:
        if not self._stop.is_set():
            self.exit_reason, self.exit_code = reason, code
            self._stop.set()

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("%s: shutting down (again to force)", signal.Signals(sig).name)
            self.request_stop(signal.Signals(sig).name, 0)
        else:
            self._force_exit(f"second {signal.Signals(sig).name}")

    def _force_exit(self, why: str) -> None:
        log.error("forced exit: %s", why)
        if self.actors is not None:
            self.actors.kill()
        os._exit(130)

    async def _shutdown(self) -> None:
        timer = self._loop.call_later(self.cfg.shutdown_timeout_s, self._force_exit, "shutdown timeout")
        try:
            self._train_stop.set()  # intake already stopped: the receive task is cancelled
            self.ring.close()
            await self._loop.run_in_executor(None, self._trainer.join, self.cfg.shutdown_timeout_s)
            if self._trainer_error is None:
                path = await self._loop.run_in_executor(None, self.save_checkpoint)
                log.info("final checkpoint: %s", path)
            self._report()
            self.progress.close()
            if self.actors is not None:
                await self._loop.run_in_executor(None, self.actors.stop, max(1.0, self.cfg.shutdown_timeout_s / 2))
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._loop.remove_signal_handler(sig)
            self.pull.close(0)
            self.pub.close(0)
            self.ctx.term()
            self.metrics.close()
            timer.cancel()
        log.info("learner stopped: %s", self.exit_reason)

    # --------------------------------------------------------------------------------------------------- intake
    async def _receive_loop(self) -> None:
        pull, sync = self.pull, self._pull_sync
        while True:
            if self._pending is not None and not self._continue_pending():
                self._room.clear()
                if not self.ring.writable():  # the trainer may have released a slot meanwhile
                    try:
                        await asyncio.wait_for(self._room.wait(), 0.1)
                    except asyncio.TimeoutError:
                        pass
                continue
            if not await pull.poll(100, zmq.POLLIN):
                continue
            deadline = time.monotonic() + MAX_DRAIN_S
            for _ in range(MAX_DRAIN_MESSAGES):
                try:
                    frame = sync.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frame.buffer)
                if self._pending is not None or time.monotonic() > deadline:
                    break
            await asyncio.sleep(0)

    def _handle(self, buf) -> None:
        self.messages_received += 1
        self.bytes_received += len(buf)
        try:
            msg = self.decoder.parse(buf)
            version = self.policy_version
            if msg.policy_version > version:
                raise wire.Rejected("future_version", f"policy version {msg.policy_version} > learner's {version}")
            last = self._last_seq.get(msg.actor_id)
            if last is not None and msg.seq <= last:
                raise wire.Rejected("replay", f"actor {msg.actor_id!r} seq {msg.seq} <= {last}")
        except wire.Rejected as e:
            self._reject(e)
            return
        self._last_seq[msg.actor_id] = msg.seq
        self._last_seq.move_to_end(msg.actor_id)
        if len(self._last_seq) > self.cfg.max_tracked_actors:
            self._last_seq.popitem(last=False)
        for ret, length in msg.episodes:
            self.returns.append(ret)
            self.lengths.append(length)
        self.episodes += len(msg.episodes)
        if version - msg.policy_version > self.cfg.max_policy_lag:
            self.dropped_stale_arrival += msg.n
            return
        self._pending = (msg, 0, time.monotonic_ns())
        self._continue_pending()

    def _continue_pending(self) -> bool:
        """Decode what fits of the pending message into the ring. True when it is done."""
        msg, i, arrival = self._pending
        ring = self.ring
        while i < msg.n:
            if not ring.writable():
                self._pending = (msg, i, arrival)
                return False
            try:
                self.decoder.decode_into(msg, i, ring.slot())
            except wire.Rejected as e:
                self._reject(e)
            else:
                ring.commit(msg.policy_version, arrival)
                self.trajectories_received += 1
                self.env_steps += self.steps_per_trajectory
                now = time.monotonic()
                self._last_data_at = now
                if self._first_data_at is None:
                    self._first_data_at = now
            i += 1
        self._pending = None
        return True

    def _reject(self, e: wire.Rejected) -> None:
        n = self.rejected[e.reason]
        self.rejected[e.reason] = n + 1
        if n < 10 or (n & (n - 1)) == 0:  # rate-limited: the first ten, then at powers of two
            log.warning("rejected a message (%d so far for this reason): %s", n + 1, e)

    # ------------------------------------------------------------------------------------------------- training
    def _train_loop(self) -> None:
        try:
            torch.set_num_threads(max(1, torch.get_num_threads()))
            cuda = self.device.type == "cuda"
            copy_stream = torch.cuda.Stream(self.device) if cuda else None
            last_pub = last_ckpt = time.monotonic()
            while not self._train_stop.is_set():
                batch = self.ring.get(0.1, min_policy_version=self.policy_version - self.cfg.max_policy_lag)
                if batch is None:
                    continue
                if cuda:
                    with torch.cuda.stream(copy_stream):
                        tensors = {k: v.to(self.device, non_blocking=True) for k, v in batch.tensors.items()}
                        copied = torch.cuda.Event()
                        copied.record(copy_stream)
                    torch.cuda.current_stream(self.device).wait_event(copied)
                else:
                    tensors = batch.tensors
                lag = self.policy_version - batch.policy_versions
                stats = self.learner.step(tensors)
                if cuda:
                    copied.synchronize()  # the pinned slot may be refilled only once its copy is complete
                self.ring.release(batch)
                self.policy_version += 1
                with self._stats_lock:
                    self._stats.append(stats)
                    self._lags.append((int(lag.min()), float(lag.mean()), int(lag.max())))
                now = time.monotonic()
                if now - last_pub >= self.cfg.publish_interval_s:
                    last_pub = now
                    self._loop.call_soon_threadsafe(self._publish, self._encode_weights())
                if now - last_ckpt >= self.cfg.checkpoint_interval_s:
                    last_ckpt = now
                    self.save_checkpoint()
                if self.learner.env_steps_trained >= self.cfg.total_env_steps:
                    self._loop.call_soon_threadsafe(self.request_stop, "total_env_steps reached", 0)
                    break
        except BaseException as e:  # reported by the event loop; the run exits non-zero
            self._trainer_error = e
            log.exception("training thread failed")
            self._loop.call_soon_threadsafe(self.request_stop, f"training failed: {e!r}", 1)

    def _encode_weights(self) -> bytes:
        state = {k: v.detach().to("cpu").numpy() for k, v in self.learner.model.state_dict().items()}
        return wire.encode_weights(self.policy_version, state, self.run_info)

    def _publish_now(self) -> None:
        self._publish(self._encode_weights())

    def _publish(self, data: bytes) -> None:
        self._weights = data
        try:
            self.pub.send(data, zmq.NOBLOCK)
        except zmq.Again:
            pass

    async def _republish_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.republish_interval_s)
            if self._weights is not None:
                self._publish(self._weights)

    # -------------------------------------------------------------------------------------------- supervision
    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            if self.actors is not None:
                self.actors.check()
            if self._first_data_at is None and time.monotonic() - self.t0 > self.cfg.actor_start_timeout_s:
                self.request_stop(f"no trajectory arrived within actor_start_timeout_s="
                                  f"{self.cfg.actor_start_timeout_s:g} s of start", 2)

    # ---------------------------------------------------------------------------------------------- reporting
    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.report_interval_s)
            self._report()

    def _report(self) -> None:
        now = time.monotonic()
        prev = self._prev_report
        dt = max(1e-9, now - prev[0])
        with self._stats_lock:
            stats, self._stats = self._stats, []
            lags, self._lags = self._lags, []
        rec = {
            "wall_s": round(self.wall_offset_s + now - self.t0, 3),
            "env_steps": self.env_steps,
            "env_steps_trained": self.learner.env_steps_trained,
            "learner_steps": self.learner.updates,
            "sps": round((self.env_steps - prev[1]) / dt, 1),
            "episode_return_mean": float(np.mean(self.returns)) if self.returns else None,
            "episode_length_mean": float(np.mean(self.lengths)) if self.lengths else None,
            "episodes": self.episodes,
            "policy_version": self.policy_version,
            "policy_lag_min": min(lag[0] for lag in lags) if lags else None,
            "policy_lag_avg": round(float(np.mean([lag[1] for lag in lags])), 2) if lags else None,
            "policy_lag_max": max(lag[2] for lag in lags) if lags else None,
            "trajectories_received": self.trajectories_received,
            "trajectories_rejected": sum(self.rejected.values()),
            "trajectories_dropped": self.ring.dropped_full + self.ring.dropped_stale + self.dropped_stale_arrival,
            "dropped_full": self.ring.dropped_full,
            "dropped_stale": self.ring.dropped_stale + self.dropped_stale_arrival,
            "messages_received": self.messages_received,
            "bytes_received": self.bytes_received,
            "ring_ready_batches": self.ring.ready_batches(),
        }
        for reason in wire.REJECT_REASONS:
            rec[f"rejected_{reason}"] = self.rejected[reason]
        for name in ("loss_pg", "loss_baseline", "entropy", "grad_norm", "rho_mean", "rho_clipped_frac", "lr"):
            rec[name] = float(np.mean([s[name] for s in stats])) if stats else None
        rec["rho_hist"] = np.sum([s["rho_hist"] for s in stats], axis=0).tolist() if stats else None
        rec["rho_hist_edges"] = list(RHO_BIN_EDGES)
        self._prev_report = (now, self.env_steps)
        self.metrics.write(rec)
        self.progress.show(rec)

    # -------------------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict:
        return {
            "learner": self.learner.state_dict(),
            "policy_version": self.policy_version,
            "env_steps": self.env_steps,
            "episodes": self.episodes,
            "returns": list(self.returns),
            "lengths": list(self.lengths),
            "wall_s": self.wall_offset_s + time.monotonic() - self.t0,
            "config": asdict(self.cfg),
            "spec": self.spec.to_dict(),
            "torch_rng": torch.get_rng_state(),
        }

    def save_checkpoint(self) -> Path:
        return checkpoint.save(self.logdir, self.checkpoint_state(), self.learner.env_steps_trained)

    def _restore_counters(self, state: dict) -> None:
        self.policy_version = int(state["policy_version"])
        self.env_steps = int(state["env_steps"])
        self.episodes = int(state["episodes"])
        self.returns.extend(state["returns"])
        self.lengths.extend(state["lengths"])
        self.wall_offset_s = float(state["wall_s"])
        torch.set_rng_state(state["torch_rng"])
