"""Reproducible runs (``--reproducible 1``; docs/design.md, Reproducible runs): what one round of the lockstep is, and
what the mode cannot cover.

A round is one unroll of every local actor: ``num_actors x envs_per_actor`` trajectories, acted with the same weights,
entering the ring in a fixed order and filling whole batches. The learner trains the round's batches, publishes the
weights, and the actors' next unrolls act with exactly those (policy lag 0 at the start of a round, ``round_batches -
1`` at its last batch). Pure: no zmq, no torch.
"""

from __future__ import annotations

ACTOR_ID_PREFIX = "lockstep/"  # a local actor in lockstep sends as "lockstep/<its index>": the learner orders by it


def actor_id(index: int) -> str:
    """The id actor ``index`` sends under in lockstep (the learner's order of a round's messages comes from it)."""
    return f"{ACTOR_ID_PREFIX}{index}"


def actor_index(actor_id: str) -> int | None:
    """The index in a lockstep actor id; None for any other id."""
    prefix, _, digits = actor_id.rpartition("/")
    if prefix + "/" != ACTOR_ID_PREFIX or not digits.isdigit() or len(digits) > 6:
        return None
    return int(digits)


def round_trajectories(cfg) -> int:
    """Trajectories in one round: every local actor's unroll."""
    return cfg.local_actors * cfg.actors.envs_per_actor


def round_batches(cfg) -> int:
    """Batches one round fills (whole, when the configuration is not refused)."""
    return max(1, round_trajectories(cfg) // cfg.loss.batch_size)


def max_held_messages(cfg) -> int:
    """The most messages the learner holds for their turn: two rounds, even at one trajectory a message."""
    return 2 * round_trajectories(cfg)


def refusals(cfg, device_type: str) -> list[str]:
    """Why ``cfg`` cannot run reproducibly with the learner on ``device_type``, one line each; empty where it can or
    where ``--reproducible`` is off."""
    if not cfg.run.reproducible:
        return []
    out = []
    n, k, b = cfg.local_actors, cfg.actors.envs_per_actor, cfg.loss.batch_size
    if n <= 0:
        out.append("needs train's local actors (num_actors >= 1): remote actors do not follow the lockstep")
    elif (n * k) % b:
        out.append(
            f"num_actors x envs_per_actor ({n} x {k} = {n * k}) must be a multiple of batch_size {b}: "
            "each round of unrolls fills whole batches"
        )
    if cfg.ranks.learner_ranks > 1:
        out.append(f"learner_ranks {cfg.ranks.learner_ranks}: several ranks average gradients in no fixed order")
    if device_type == "cuda" or cfg.actors.device != "cpu":
        out.append("CUDA kernels have no deterministic variant for every operation here: use device cpu")
    if cfg.run.ingest_only:
        out.append("ingest_only trains nothing: there is nothing to reproduce")
    batches = round_batches(cfg)
    if cfg.ring.max_policy_lag < batches - 1:
        out.append(
            f"max_policy_lag {cfg.ring.max_policy_lag} would drop a round's last batches (their lag is up to "
            f"{batches - 1})"
        )
    if cfg.ring.ring_batches and cfg.ring.ring_batches < batches + 1:
        out.append(f"ring_batches {cfg.ring.ring_batches} cannot hold a round ({batches} batches) and one more")
    return [f"--reproducible 1: {r}" for r in out]
