"""docs/protocol.md's Atari preprocessing reimplemented from the text alone, on a bare ``ale_py.ALEInterface``: the
reference that tests/test_atari_doc.py holds ``make_env`` to and tests/test_envpool.py holds EnvPool to. Importers
skip first where the ``[atari]`` extra is missing."""

import ale_py
import cv2
import numpy as np
from ale_py import roms

WRONG = ("resize_before_max", "bgr_grey", "no_max", "final_screen_at_end", "noops_in_agent_steps")


class DocAtari:
    """An Atari id's environment as the protocol document describes it (``wrong`` changes one detail)."""

    def __init__(
        self,
        game: str,
        repeat_action_probability: float,
        max_num_frames_per_episode: int = 108_000,
        wrong: str | None = None,
    ):
        assert wrong is None or wrong in WRONG
        self.game, self.wrong = game, wrong
        self.ale = ale_py.ALEInterface()
        self.ale.setLoggerMode(ale_py.LoggerMode.Error)
        self.ale.setFloat("repeat_action_probability", repeat_action_probability)  # sticky actions, per frame
        self.ale.setInt("max_num_frames_per_episode", max_num_frames_per_episode)
        self.rng: np.random.Generator | None = None
        self.noops = 0
        self.ended_at = None  # the frame (1-4) of the last step on which the episode ended, else None

    def _seed(self, seed: int) -> None:
        # seed -> two 32-bit words: the first seeds the no-op generator, the second (as a signed int32) the ALE,
        # whose RNG (the sticky-action draws) is set up when the ROM is loaded.
        np_word, ale_word = (int(w) for w in np.random.SeedSequence(seed).generate_state(2))
        self.rng = np.random.default_rng(np_word)
        self.ale.setInt("random_seed", ale_word - (1 << 32) if ale_word >= 1 << 31 else ale_word)
        self.ale.loadROM(roms.get_rom_path(self.game))
        self.action_set = self.ale.getMinimalActionSet()

    def _ended(self) -> tuple[bool, bool]:
        return self.ale.game_over(with_truncation=False), self.ale.game_truncated()

    def _grey(self) -> np.ndarray:
        rgb = self.ale.getScreenRGB()
        if self.wrong == "bgr_grey":
            return cv2.cvtColor(rgb, cv2.COLOR_BGR2GRAY)
        grey = self.ale.getScreenGrayscale()
        # The doc's aside: on the NTSC palette, OpenCV's RGB->grey of the RGB screen is the same picture.
        np.testing.assert_array_equal(cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY), grey)
        return grey

    def _frame(self) -> np.ndarray:
        if self.wrong == "resize_before_max":
            small = np.maximum(self._resize(self.pooled), self._resize(self.third))
            self.pooled = np.maximum(self.pooled, self.third)
            return small
        if self.wrong != "no_max":
            self.pooled = np.maximum(self.pooled, self.third)  # max-pool the two 210x160 grey screens
        return self._resize(self.pooled)

    @staticmethod
    def _resize(grey: np.ndarray) -> np.ndarray:
        assert grey.shape == (210, 160) and grey.dtype == np.uint8
        return cv2.resize(grey, (84, 84), interpolation=cv2.INTER_AREA)

    def reset(self, seed: int | None = None) -> np.ndarray:
        if seed is not None:
            self._seed(seed)
        self.ale.reset_game()
        self.noops = int(self.rng.integers(1, 30 + 1))  # 1 to 30 inclusive, never 0
        for _ in range(self.noops * (4 if self.wrong == "noops_in_agent_steps" else 1)):
            self.ale.act(self.action_set[0])  # NOOP, one emulator frame; its reward is dropped
            if any(self._ended()):
                if seed is not None:
                    self._seed(seed)
                self.ale.reset_game()  # and the remaining no-ops go on, not redrawn
        self.pooled, self.third = self._grey(), np.zeros((210, 160), np.uint8)
        self.previous = self.pooled
        self.stack = [self._frame()] * 4  # the first frame in all 4 slots
        return np.stack(self.stack)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool]:
        reward, terminated, truncated, self.ended_at = 0.0, False, False, None
        for j in (1, 2, 3, 4):
            reward += self.ale.act(self.action_set[action])
            terminated, truncated = self._ended()
            if self.wrong == "final_screen_at_end":
                now = self._grey()
                if terminated or truncated:
                    self.third, self.pooled = self.previous, now
                self.previous = now
            if terminated or truncated:
                self.ended_at = j
                break  # no further frames; frame j's screen is not read
            if j == 3:
                self.third = self._grey()
            elif j == 4:
                self.pooled = self._grey()
        self.stack = self.stack[1:] + [self._frame()]  # oldest first
        return np.stack(self.stack), reward, terminated, truncated
