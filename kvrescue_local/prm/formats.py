"""How a PRM reads a trajectory: its prompt, where each step's reward is read, and its output.

A format is data: the text before the first step, the text that closes each step (the
reward is read from the hidden state at the last token of that closing text), and how the
head's output becomes a reward. A format read "as held" takes each step as the helper model's
context holds it: the text as sampled, nothing stripped or appended, the reward read at its own
last token (`--prm helper`, kvrescue_local/rescue/judge.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import KVRescueError

QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
# Qwen2.5-Math's chat prompt (a str.format template, hence {{}}): the real presets' models solve in it
QWEN_MATH_CHAT = ("<|im_start|>system\n" + QWEN_MATH_SYSTEM.replace("{", "{{").replace("}", "}}") +
                  "<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n")


@dataclass(frozen=True)
class PRMFormat:
    name: str
    prompt: str  # str.format template with {problem} and {bos}
    step_end: str  # appended to each (stripped) step; the reward is read at its last token
    output: str  # "softmax1": probability of class 1 of a 2-way head; "sigmoid": sigmoid of a 1-way head
    as_held: bool = False  # steps as the helper holds them: step_tokens reads the text as it is (step_end unused)

    def header(self, problem: str, bos: str, prompt: str | None = None) -> str:
        """The text before the first step: the format's prompt, or `prompt` (a head's own, RewardHead.prompt)."""
        return (prompt or self.prompt).format(problem=problem, bos=bos)

    def step_text(self, step: str) -> str:
        return step.strip() + self.step_end

    def step_tokens(self, model, step: str) -> np.ndarray:
        """The tokens a step is read in. As held: the text tokenized as plain text (as the loop queues a step for
        the helper), and an empty step (a bare end of generation) read at the model's end-of-generation token."""
        if not self.as_held:
            return model.tokenize(self.step_text(step))
        tokens = model.tokenize(step, special=False)
        return tokens if len(tokens) else np.array([model.eos], np.int32)


FORMATS = {
    # Qwen2.5-Math-PRM: chat template, steps joined by <extra_0> with a trailing one.
    "qwen-prm": PRMFormat(
        name="qwen-prm",
        prompt=QWEN_MATH_CHAT,
        step_end="<extra_0>",
        output="softmax1",
    ),
    # The toy world's PRM (kvrescue_local.toy): qwen-prm in the text its backbone, the toy base, was
    # trained on: no system turn, and steps still end in a blank line before the reward token.
    "toy-prm": PRMFormat(
        name="toy-prm",
        prompt="<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n",
        step_end="\n\n<extra_0>",
        output="softmax1",
    ),
    # A value head on a chat model itself (the coder preset's PRM: a head trained on the 0.5B's own hidden
    # states, `kvrescue-local prm train`): the chat prompt the models solve in, steps as the loop commits
    # them (each ends in a blank line), the reward read at that blank line, sigmoid.
    "chat-value": PRMFormat(
        name="chat-value",
        prompt=QWEN_MATH_CHAT,
        step_end="\n\n",
        output="sigmoid",
    ),
    # A value head on the helper model's own context (`--prm helper`): the chat prompt the models solve in, each
    # step as the helper holds it (its blank line, or none when max_step_tokens cut it), the reward read at the
    # step's last token, sigmoid. A head of this format records the model file it was trained on.
    "helper-value": PRMFormat(
        name="helper-value",
        prompt=QWEN_MATH_CHAT,
        step_end="",
        output="sigmoid",
        as_held=True,
    ),
    # Skywork-o1-Open-PRM: bos + problem + "\n", each step closed by "\n", sigmoid value head.
    "value-head": PRMFormat(name="value-head", prompt="{bos}{problem}\n", step_end="\n", output="sigmoid"),
}


def prm_format(name: str) -> PRMFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise KVRescueError(f"unknown PRM format {name!r}: use one of {', '.join(sorted(FORMATS))}") from None
