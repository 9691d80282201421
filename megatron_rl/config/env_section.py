"""The `env` section: the environment of a multi-turn rollout (rollout/multi_turn.py).

Checked when the config loads: the values, and the environment with its settings (it is built once,
so a wrong setting's name or type fails at start-up naming env.settings).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl import checks


@dataclass
class EnvSection:
    """The environment of a multi-turn rollout (rollout.function=multi_turn; rollout/multi_turn.py).

    name: a registered environment (megatron_rl.data.envs.ENVS: "calculator", "guess"), the
        user's Environment subclass as "package.module:Class" (see plugins), or null when the
        rollout function needs none. settings: keyword settings of the environment's class (e.g.
        {call_open: "c:"}), checked when the config loads (names and types). An override merges
        into the file's settings; env.settings={} empties them (another env.name takes other
        settings). A data.jsonl row may name its own ("env", "env_settings"), which wins for that
        row's trajectories.
    max_turns: most policy turns per trajectory (the environment's own max_turns may end it
        sooner). max_tokens: most response tokens per trajectory, sampled and environment ones
        together (each turn samples at most rollout.max_tokens of them).
    timeout_s: how long one environment call (reset or step) may take; a call that raises or takes
        longer ends its trajectory with reward 0, counted in env/failures and env/timeouts.
    max_calls_in_flight: the most environment calls (resets and steps of all trajectories) that
        run at once (default 64, >= 1): each runs in a thread of its own, so this bounds the
        threads (and a remote environment server's concurrent requests); a call waits for a place
        before its timeout_s starts. A call abandoned at its deadline frees its place.
    max_stuck_calls: the most calls past timeout_s that may still run (default 32, >= 0): a
        thread cannot be stopped, so a call that hangs or loops keeps its thread and slows the
        trainer; one more stops the run naming the environment (rollout/env_calls.py). A call
        that returns late frees its place.
    observation_prefix / observation_suffix: text put around every observation before it is
        tokenized, alone (a chat template's turn delimiters, e.g. "<|im_start|>user\\n" and
        "<|im_end|>\\n<|im_start|>assistant\\n" for ChatML); "" for the character tokenizer.
    turns: how trajectories reach the engine (rollout/requests.py): "lockstep" (default): every
        engine call holds one request of every running trajectory (each turn waits for the
        slowest environment), so calls, and a resumed run, are bit-exact; "async": each trajectory
        goes turn -> environment -> turn on its own, and the engine gets the requests pending
        whenever it is free, so none waits for the slowest environment (a sample's numbers then
        depend on which requests shared its batch, by the engine's batch-shape noise: fp32 ~1e-6).
        With the vLLM engine each async request is sent as it comes (its own HTTP request; the
        server batches). With the embedded engine, async requests join its running batch at every
        decode step: 1.4x lockstep's rollout throughput at 1-4 turns, 2.3x at 1-8, with a heavy-tailed
        environment on 2 CPU cores (benchmarks/rollout_throughput.py). Lockstep stays the default
        for its bit-exact resume.
    check_render: also re-encode every trajectory's text and count the trajectories whose ids
        differ from the kept ones (env/render_drift, of which env/render_unencodable could not be
        encoded at all; never corrected: the kept ids are trained). With an HF tokenizer that has
        a chat template, the conversation is rendered by that template (policy turns as assistant
        messages, observations in the environment's observation_role), as a text-keeping
        pipeline would re-render it.
    """

    name: str | None = None
    settings: dict = field(default_factory=dict)
    max_turns: int = 4
    max_tokens: int = 64
    timeout_s: float = 10.0
    max_calls_in_flight: int = 64
    max_stuck_calls: int = 32
    observation_prefix: str = ""
    observation_suffix: str = ""
    check_render: bool = False
    turns: str = "lockstep"

    def __post_init__(self):
        checks.integer("env.max_turns", self.max_turns, lo=1)
        checks.choice("env.turns", self.turns, ("async", "lockstep"))
        checks.integer("env.max_tokens", self.max_tokens, lo=1)
        checks.number("env.timeout_s", self.timeout_s, lo=0, lo_open=True)
        checks.integer("env.max_calls_in_flight", self.max_calls_in_flight, lo=1)
        checks.integer("env.max_stuck_calls", self.max_stuck_calls, lo=0,
                       hint="0 stops the run at the first call that outlives env.timeout_s")
        checks.boolean("env.check_render", self.check_render)
        for key in ("observation_prefix", "observation_suffix"):
            if not isinstance(getattr(self, key), str):
                raise TypeError(f"env.{key}={getattr(self, key)!r}: a string")
        if not isinstance(self.settings, dict):
            raise TypeError(f"env.settings={self.settings!r}: a mapping of the environment's settings")
        if self.name is not None:
            from megatron_rl.data.envs import make_env

            try:
                make_env(self.name, **self.settings)
            except KeyError as e:
                raise ValueError(f"env.name: {e.args[0]}") from None
            except (TypeError, ValueError) as e:
                hint = (" (env.settings={} drops the settings the config file gave another environment)"
                        if "takes no setting" in str(e) else "")
                raise ValueError(f"env.settings: {e}{hint}") from None
