"""Incremental detokenization of one generated sequence, with OpenAI `stop` strings."""
from __future__ import annotations


class TextStream:
    """Each update decodes only a short window of tokens (the last emitted few plus the new ones), so a long
    reply costs O(new tokens) per step, not O(all tokens)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]          # strings that end the text (not included in it)
        self.text = ""                              # all text decoded so far
        self.sent = 0                               # characters of `text` already handed out
        self.stopped = False                        # a stop string was found
        self._prefix_offset = 0                     # window start: tokens before it are settled text
        self._read_offset = 0                       # tokens whose text is in `text`

    def _decode_new(self, token_ids: list[int], is_final: bool) -> None:
        decode = self.tokenizer.decode
        prefix = decode(token_ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        window = decode(token_ids[self._prefix_offset:], skip_special_tokens=True)
        if len(window) > len(prefix) and (is_final or not window.endswith("\ufffd")):   # hold a partial character
            self.text += window[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)

    def update(self, token_ids: list[int], is_final: bool) -> str:
        """All tokens so far -> the new text to send. Holds back an incomplete UTF-8 character and a tail that
        may still grow into a stop string, unless this is the final update."""
        if self.stopped:
            return ""
        self._decode_new(token_ids, is_final)
        end = len(self.text)
        for stop in self.stop:
            index = self.text.find(stop, max(0, self.sent - len(stop)))
            if index != -1:
                end = min(end, index)
                self.stopped = True
        if not (self.stopped or is_final):
            for stop in self.stop:                  # keep back a suffix that is a prefix of a stop string
                for k in range(min(len(stop) - 1, end), 0, -1):
                    if self.text[:end].endswith(stop[:k]):
                        end -= k
                        break
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:end], end
        return delta
