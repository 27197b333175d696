"""The learner's configuration, section by section (``impala-async train --help`` prints them in this order): the
sections of training here (run, environment, model, loss and optimiser, ring and flow control), those of the learner
as a service in config/service.py.

Every field is a flag of ``train`` and ``learner`` (``--field-name``) and a key of a ``--config`` file; limits are
named ``max_*`` with their unit in the name, durations end in ``_s``. A value of 0 (or "") that means *auto* is
filled once, by :func:`impala_async.config.resolve.resolve`; nothing changes a config after that.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .fields import Section, at_least, finite, finite_positive, need, opt, positive

MODEL_CHOICES = ("auto", "mlp", "shallow", "minatar", "deep")
CURRICULA = ("none", "linear")  # the schedules of learner/curriculum.py, and none
FLOW_CONTROLS = ("pace", "none")  # learner/transport/pacing.py
OBS_CODECS = ("lz4", "jpeg")  # how actors are asked to send image observations (core/codecs.py)
ENV_BACKENDS = ("auto", "gymnasium", "envpool")  # actors/vec.py
DEFAULT_ENV_BACKEND = "auto"  # envpool for Atari where installed: ~10% more Pong steps per actor core (BENCHMARKS.md 9)
PRESETS = ("auto", "none", "classic", "minatar", "atari")  # config/presets.py
AUTO_SCRATCH_BYTES = 64 << 20  # decoded bytes of one message at most, when max_trajectories_per_message is auto
# Modules an env id "module:Name" may name from a file (a checkpoint's configuration, --config): the package's own
# test environments, imported with the package anyway. Any other module only from --env typed on the command line, or
# with --allow-env-module 1 typed there (config/layers.py, env_module_refusal): importing a module runs its code, and
# a file must not be able to make the learner or eval run code.
OWN_ENV_MODULES = ("impala_async.actors.envs",)


def env_module(env_id: str) -> str:
    """The module an env id of the form ``module:Name`` makes gymnasium import ("" for a plain id)."""
    module, sep, _ = env_id.partition(":")
    return module if sep else ""


MAX_LEARNING_RATE = 1.0  # above it Adam and RMSprop move every weight by more than the weights' own scale a step
IMAGE_THREADS_MIN_VALUES = 4096  # observations of this many values or more take 2 learner threads by default


@dataclass(frozen=True)
class Run(Section):
    """The run: where it trains, for how long, and where its files go."""

    NAME = "run"
    TITLE = "run"
    preset: str = opt(
        "auto",
        "values for an environment family, below --config and flags: auto (chosen from --env), "
        "none, classic, minatar or atari (config/presets.py)",
        choices=PRESETS,
    )
    seed: int = opt(0, "random seed of the learner; actor i seeds its environments from seed, i and env index")
    logdir: str = opt("", "directory for metrics.jsonl, config.json and checkpoints (default: runs/<env>-<UTC time>)")
    device: str = opt("auto", "where the learner trains: auto (cuda if available), cpu or cuda[:N]")
    learner_threads: int = opt(
        0,
        "torch threads of the learner's update on a CPU; 0: 2 (if the machine has them) for image observations of "
        f"{IMAGE_THREADS_MIN_VALUES} values or more, where a convolutional update gains from a second thread, else 1, "
        "where a small network's update loses",
    )
    total_env_steps: int = opt(1_000_000, "stop after training on this many environment steps")
    ingest_only: int = opt(
        0, "1: decode into the ring and release batches without training (load tests)", choices=(0, 1)
    )
    overlap_copies: int = opt(
        1, "CUDA: copy batch k+1 to the GPU on its own stream while batch k trains (0: serial)", choices=(0, 1)
    )
    shutdown_timeout_s: float = opt(10.0, "graceful shutdown gives up and forces exit after this long")
    actor_start_timeout_s: float = opt(120.0, "exit non-zero if no trajectory arrives this long after start")
    no_data_timeout_s: float = opt(60.0, "exit non-zero if no trajectory arrives for this long once data has flowed")
    reproducible: int = opt(
        0,
        "1: the same configuration and seed give the same run, bit for bit, on the same machine and software: train's "
        "local actors act in lockstep with the learner (each unroll with the weights its position fixes) and "
        "trajectories enter batches in actor order; slower (docs/design.md, Reproducible runs)",
        choices=(0, 1),
    )

    def check(self) -> None:
        super().check()
        need(
            self.device in ("auto", "cpu") or self.device.startswith("cuda"),
            f"device must be auto, cpu or cuda[:N], got {self.device!r}",
        )
        need(self.total_env_steps > 0, "total_env_steps must be > 0: the run would end before it starts")
        need(self.learner_threads >= 0, f"learner_threads must be >= 0 (0: chosen), got {self.learner_threads}")
        positive(self, "shutdown_timeout_s", "actor_start_timeout_s", "no_data_timeout_s")


@dataclass(frozen=True)
class Env(Section):
    """The environment actors play, how they send it, and its curriculum."""

    NAME = "env"
    TITLE = "environment"
    env: str = opt(
        "CartPole-v1",
        "gymnasium environment id (Discrete actions; vector or uint8-image observations); module:Name imports "
        "module first (from a --config file or a checkpoint only with --allow-env-module 1 typed)",
    )
    allow_env_module: int = opt(
        0,
        "1: take an env id of the form module:Name (which imports module, running its code) from a --config file or "
        "the checkpoint a --resume continues; counts only typed on the command line (an id typed with --env, and "
        f"ids of {', '.join(OWN_ENV_MODULES)}, need no such permission)",
        choices=(0, 1),
    )
    env_kwargs: str = opt(
        "",
        "JSON object of keyword arguments for the environment, the same in learner and "
        "actors: '{\"max_episode_steps\": 200}'; for ALE '{\"repeat_action_probability\": 0}'",
    )
    env_backend: str = opt(
        DEFAULT_ENV_BACKEND,
        "how actors step Atari ids: gymnasium, envpool (EnvPool's C++ batch, "
        "pip install 'impala-async[envpool]'), or auto (envpool where "
        "installed, else gymnasium); other ids (MinAtar, CartPole, ...) "
        "always use gymnasium. Sent to actors as run.env_backend (the "
        "backend chosen); an actor's --env-backend wins",
        choices=ENV_BACKENDS,
    )
    unroll_length: int = opt(20, "T: environment steps per trajectory")
    frame_dedup: int = opt(
        1,
        "1: observations that stack consecutive frames (Atari) travel and sit in the ring as "
        "single frames, 4x less data; 0: whole stacks",
        choices=(0, 1),
    )
    obs_codec: str = opt(
        "lz4",
        "how actors send uint8 image observations (obs, frames): lz4 (lossless) or jpeg "
        "(lossy, at --jpeg-quality; needs pip install 'impala-async[jpeg]'); every other "
        "field travels as lz4. The learner accepts lz4, jpeg or none from any actor",
        choices=OBS_CODECS,
    )
    jpeg_quality: int = opt(90, "JPEG quality, 1 to 100, that actors encode images with under --obs-codec jpeg")
    curriculum: str = opt(
        "none",
        "environment difficulty by the env steps the learner trained: none, or linear "
        "(curriculum_start to curriculum_end over curriculum_env_steps); the value travels "
        "with the weights and each environment gets it through "
        "env.unwrapped.set_difficulty(value) at its next reset (README, Curriculum)",
        choices=CURRICULA,
    )
    curriculum_start: float = opt(0.5, "difficulty at 0 env steps trained")
    curriculum_end: float = opt(2.0, "difficulty from curriculum_env_steps trained on")
    curriculum_env_steps: int = opt(
        1_000_000,
        "env steps trained over which a linear curriculum goes from start to end (the learner's own count: no peer's "
        "claim moves it)",
    )

    def check(self) -> None:
        super().check()
        try:
            self.env_kwargs_dict  # noqa: B018 (parsed for its errors)
        except ValueError as e:
            raise ValueError(f"env_kwargs: {e}") from None
        at_least(self, 1, "unroll_length", "curriculum_env_steps")
        need(1 <= self.jpeg_quality <= 100, f"jpeg_quality must lie in [1, 100], got {self.jpeg_quality}")
        need(
            math.isfinite(self.curriculum_start) and math.isfinite(self.curriculum_end),
            "curriculum_start and curriculum_end must be finite: they travel to actors as difficulties",
        )

    @property
    def env_kwargs_dict(self) -> dict:
        """``env_kwargs`` parsed; ValueError unless it is empty or a JSON object."""
        if not self.env_kwargs.strip():
            return {}
        try:
            value = json.loads(self.env_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e}): {self.env_kwargs!r}") from None
        if type(value) is not dict:
            raise ValueError(f"must be a JSON object such as '{{\"max_episode_steps\": 200}}', got {self.env_kwargs!r}")
        return value


@dataclass(frozen=True)
class Model(Section):
    """The network (core/models.py; docs/protocol.md, The network)."""

    NAME = "model"
    TITLE = "model"
    model: str = opt(
        "auto",
        "network: auto (mlp for vectors; for uint8 images the MinAtar net up to 16x16 pixels, the "
        "Nature CNN above), mlp, shallow (the Nature CNN), minatar, or deep (the IMPALA ResNet)",
        choices=MODEL_CHOICES,
    )
    hidden_sizes: str = opt("64,64", "MLP layer widths, comma separated (vector observations)")
    activation: str = opt("tanh", "MLP activation: tanh, relu or elu")
    use_lstm: int = opt(
        0, "1: an LSTM core after the torso (image networks); actors carry its state across unrolls", choices=(0, 1)
    )
    lstm_size: int = opt(256, "units of the LSTM core (with --use-lstm 1)")
    input_scale: float = opt(
        0.0,
        "image networks multiply uint8 pixels by this (0: auto, 1 / the observation space's "
        "maximum: 1/255 for Atari frames, 1 for MinAtar's 0/1 planes)",
    )
    obs_norm: int = opt(
        0,
        "1: image networks normalise each scaled pixel by running mean and variance (the learner's, sent with "
        "the weights), clipped to +-5, as Sample Factory's normalize_input",
        choices=(0, 1),
    )
    value_fc: int = opt(
        0,
        "1: image networks give the value head a fully connected layer of its own beside the policy's, so that "
        "only the convolutions are shared (not with --use-lstm 1)",
        choices=(0, 1),
    )

    def check(self) -> None:
        super().check()
        at_least(self, 1, "lstm_size")
        finite("input_scale", self.input_scale)
        need(
            not (self.use_lstm and self.model == "mlp"),
            "use_lstm needs an image network: the MLP has two torsos "
            "and no core (choose --model auto, shallow, minatar or deep)",
        )
        for name in ("obs_norm", "value_fc"):
            need(
                not (getattr(self, name) and self.model == "mlp"),
                f"{name} needs an image network (choose --model auto, shallow, minatar or deep)",
            )
        need(
            not (self.value_fc and self.use_lstm),
            "value_fc needs a network without an LSTM core (the core feeds both heads): choose one",
        )
        try:
            sizes = self.hidden_size_tuple
        except ValueError:
            sizes = ()
        need(
            len(sizes) >= 1 and all(h >= 1 for h in sizes),
            f"hidden_sizes must be comma-separated positive integers, got {self.hidden_sizes!r}",
        )

    @property
    def hidden_size_tuple(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.hidden_sizes.split(",") if x.strip())


@dataclass(frozen=True)
class Loss(Section):
    """The loss and the optimiser: V-trace, its costs and clips, the learning rate, and what enters the loss."""

    NAME = "loss"
    TITLE = "loss and optimiser"
    batch_size: int = opt(16, "B: trajectories per learner update")
    updates_per_batch: int = opt(
        1,
        "updates on each batch before its slot is freed (RLlib's num_epochs); above 1 each trajectory is "
        "learnt from again by a policy it moved, V-trace correcting for that; a policy version is one batch",
    )
    optimizer: str = opt(
        "adam", "adam (the source article's choice) or rmsprop (torchbeast's)", choices=("adam", "rmsprop")
    )
    learning_rate: float = opt(1e-3, "initial learning rate")
    lr_schedule: str = opt(
        "linear",
        "linear (decay to 0 at schedule_env_steps, whatever the run's budget) or constant",
        choices=("linear", "constant"),
    )
    schedule_env_steps: int = opt(
        1_000_000,
        "horizon of the linear schedules, independent of total_env_steps: the learning rate (lr_schedule linear) "
        "reaches 0 at this many env steps trained, and the entropy cost final_entropy_cost unless "
        "entropy_schedule_env_steps says otherwise",
    )
    adam_eps: float = opt(1e-5, "Adam epsilon, on the loss's mean over the batch (CleanRL's 1e-5)")
    rmsprop_alpha: float = opt(0.99, "RMSprop smoothing constant")
    rmsprop_eps: float = opt(
        0.01,
        "RMSprop epsilon in the IMPALA paper's unit, the loss summed over the batch's B x T steps (the paper's and "
        "torchbeast's 0.01; the update uses it divided by B x T, since its loss is the mean)",
    )
    rmsprop_momentum: float = opt(0.0, "RMSprop momentum")
    max_grad_norm: float = opt(
        40.0,
        "clip the global gradient norm to this in the IMPALA paper's unit, the gradient of the loss summed over the "
        "batch's B x T steps (the paper's 40; the mean loss's gradient is clipped at this / (B x T)); 0: no clipping",
    )
    precision: str = opt(
        "fp32",
        "fp32, or bf16: the network's forward pass under bf16 autocast (importance weights, "
        "V-trace and the losses stay fp32; no loss scaling needed)",
    )
    discount: float = opt(0.99, "gamma")
    entropy_cost: float = opt(0.001, "weight of the entropy bonus")
    final_entropy_cost: float = opt(
        -1.0,
        "anneal the entropy bonus linearly from entropy_cost to this at entropy_schedule_env_steps, and hold it "
        "there (-1: no annealing, entropy_cost throughout)",
    )
    entropy_schedule_env_steps: int = opt(
        0,
        "horizon of final_entropy_cost's anneal in env steps trained, independent of total_env_steps "
        "(0: schedule_env_steps, the learning rate's)",
    )
    baseline_cost: float = opt(0.5, "weight of the baseline (value) loss")
    reward_clip: float = opt(0.0, "clip rewards to [-x, x] before learning (0: no clipping)")
    reward_scale: float = opt(
        0.1,
        "multiply rewards by this before learning, after clipping (keeps values near "
        "unit scale: CartPole returns of 500 would otherwise make values of ~100)",
    )
    normalize_advantages: int = opt(
        0, "1: divide policy-gradient advantages by their batch standard deviation", choices=(0, 1)
    )
    clip_rho_threshold: float = opt(1.0, "V-trace rho-bar (0: no clipping)")
    clip_pg_rho_threshold: float = opt(1.0, "clip of the policy-gradient importance weight (0: no clipping)")
    clip_c_threshold: float = opt(1.0, "V-trace c-bar (0: no clipping)")
    vtrace_lambda: float = opt(1.0, "V-trace lambda: c_t = lambda * min(c-bar, rho_t); < 1 trades bias for variance")
    max_abs_reward: float = opt(
        1e6, "clip rewards from the wire to +-this (raw units, before --reward-clip and --reward-scale)"
    )
    max_abs_truncation_value: float = opt(1e6, "clip truncation_value to +-this (reward-scaled units)")
    max_abs_logit: float = opt(1e3, "clip behaviour_logits to +-this")
    max_abs_obs: float = opt(1e6, "clip float observations to +-this")

    def check(self) -> None:
        super().check()
        at_least(self, 1, "batch_size", "updates_per_batch", "schedule_env_steps")
        at_least(self, 0, "entropy_schedule_env_steps")
        need(
            self.precision in ("fp32", "bf16"),
            f"precision must be fp32 or bf16, got {self.precision!r} (fp16 would "
            "need loss scaling, and bf16 has fp32's range without it)",
        )
        need(
            0 < self.learning_rate <= MAX_LEARNING_RATE,
            f"learning_rate must lie in (0, {MAX_LEARNING_RATE:g}], got {self.learning_rate:g}",
        )
        need(0.0 <= self.discount <= 1.0, "discount must lie in [0, 1]: values would diverge")
        for name in (
            "entropy_cost",
            "baseline_cost",
            "reward_clip",
            "max_grad_norm",
            "clip_rho_threshold",
            "clip_pg_rho_threshold",
            "clip_c_threshold",
        ):
            finite(name, getattr(self, name))
        need(
            self.final_entropy_cost == -1.0
            or (math.isfinite(self.final_entropy_cost) and self.final_entropy_cost >= 0),
            "final_entropy_cost must be a finite number >= 0, or -1 for no annealing",
        )
        need(0.0 <= self.vtrace_lambda <= 1.0, "vtrace_lambda must lie in [0, 1]: above 1 the traces explode")
        need(self.baseline_cost > 0, "baseline_cost must be > 0: without a trained baseline V-trace targets are noise")
        positive(self, "max_abs_reward", "max_abs_truncation_value", "max_abs_logit", "max_abs_obs")
        finite_positive(self, "adam_eps", "rmsprop_eps")

    @staticmethod
    def threshold(x: float) -> float | None:
        """V-trace thresholds: 0 in the config means no clipping (None in vtrace)."""
        return None if x == 0 else x


@dataclass(frozen=True)
class Ring(Section):
    """The ring buffer between intake and training, how stale data may be, and flow control (transport/pacing.py)."""

    NAME = "ring"
    TITLE = "ring and flow control"
    ring_batches: int = opt(
        0,
        "batch slots in the ring buffer (>= 3; 0: room for a trained batch, pace's target and two of the largest "
        "messages the learner accepts (max_trajectories_per_message, or envs_per_actor if larger), at least 8)",
    )
    when_full: str = opt(
        "drop_oldest",
        "when every ring slot is taken: drop_oldest (the oldest waiting batch) or "
        "wait (stop reading; socket high-water marks then make actors wait)",
        choices=("drop_oldest", "wait"),
    )
    max_policy_lag: int = opt(100, "drop trajectories whose behaviour policy is more than this many versions old")
    flow_control: str = opt(
        "pace",
        "pace: the weights tell actors how fast to act so that they produce what "
        "training consumes (learner/transport/pacing.py; actors slow down instead of being dropped), "
        "or none (actors act as fast as they can; when_full decides what gives)",
        choices=FLOW_CONTROLS,
    )
    pace_target_batches: float = opt(
        2.0,
        "pacing: batches the learner wants waiting in its ring (fewer: less policy "
        "lag; too few and training waits for data)",
    )
    pace_window_s: float = opt(5.0, "pacing: the consumption rate and the number of actors are measured over this")
    max_pace_s_per_trajectory: float = opt(10.0, "pacing: the slowest pace the learner asks for")

    def check(self) -> None:
        super().check()
        need(
            self.ring_batches == 0 or self.ring_batches >= 3,
            "ring_batches must be 0 (auto) or >= 3 (one filling, one training, one waiting); with fewer "
            "the receiver and the trainer would wait on each other",
        )
        need(self.max_policy_lag >= 1, "max_policy_lag must be >= 1: 0 would drop everything the actors send")
        need(
            math.isfinite(self.pace_target_batches) and self.pace_target_batches > 0,
            "pace_target_batches must be > 0: with nothing waiting the trainer would wait for every batch",
        )
        positive(self, "pace_window_s", "max_pace_s_per_trajectory")
