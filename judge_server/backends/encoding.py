"""Token ids of judge prompts, shared by the transformers and vLLM backends.

Prefix and suffix are tokenised separately and concatenated, in every mode
(prefix-cache, flat batch, generation, vLLM), so all modes see the same token
sequence and the shared prefix really is a shared token prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from calibrl.errors import ConfigError, InvalidArgument
from calibrl.judge_server import prompts
from calibrl.judge_server.rubric import Criterion
from calibrl.api.judge import JudgeItem

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase


@dataclass
class EncodedBatch:
    prefix_ids: list[list[int]]  # one per item
    suffix_ids: list[list[int]]  # one per criterion


class PromptEncoder:
    """Builds prompt token ids with a Hugging Face tokenizer (vLLM exposes the same one)."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", options: prompts.PromptOptions,
                 use_chat_template: str = "auto",
                 max_length: int | None = None) -> None:
        if use_chat_template not in ("auto", "true", "false"):
            raise ConfigError(f"use_chat_template={use_chat_template!r}: must be auto, true or false")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if use_chat_template == "true" and not has_template:
            raise ConfigError("use_chat_template=true but the judge tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.options = options
        self.chat = has_template and use_chat_template != "false"
        self.max_length = max_length
        self.answer_tokens = prompts.answer_tokens(self._encode_plain, need_likert=False)

    def _encode_plain(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _apply_template(self, content: str) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)

    def prefix_text(self, item: JudgeItem, instructions: str) -> str:
        text = prompts.item_prefix(item, instructions, self.options)
        if self.chat:
            text = prompts.chat_parts(self._apply_template, text, "Q")[0]
        return text

    def suffix_text(self, criterion: Criterion) -> str:
        text = prompts.criterion_suffix(criterion)
        if self.chat:
            text = prompts.chat_parts(self._apply_template, "P\n\n", text)[1]
        return text

    def encode_prefix(self, item: JudgeItem, instructions: str) -> list[int]:
        text = self.prefix_text(item, instructions)
        if self.chat:  # the rendered template carries its own special tokens
            return self._encode_plain(text)
        ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        eos = getattr(self.tokenizer, "eos_token_id", None)
        while ids and eos is not None and ids[-1] == eos and len(ids) > 1:
            ids.pop()  # some tokenizers append EOS; the prompt continues after the prefix
        return ids

    def encode_suffix(self, criterion: Criterion) -> list[int]:
        return self._encode_plain(self.suffix_text(criterion))

    def encode(self, items: Sequence[JudgeItem], criteria: Sequence[Criterion], instructions: str) -> EncodedBatch:
        batch = EncodedBatch([self.encode_prefix(i, instructions) for i in items],
                             [self.encode_suffix(c) for c in criteria])
        if self.max_length is not None:
            longest_suffix = max((len(s) for s in batch.suffix_ids), default=0)
            for index, prefix in enumerate(batch.prefix_ids):
                if len(prefix) + longest_suffix > self.max_length:
                    raise InvalidArgument(
                        f"items[{index}]",
                        f"judge prompt is {len(prefix) + longest_suffix} tokens, the judge model takes at most "
                        f"{self.max_length}; shorten the output or retrieved_texts (or lower max_doc_chars)")
        return batch
