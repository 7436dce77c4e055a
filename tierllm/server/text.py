"""Incremental detokenization of one generated sequence, with OpenAI `stop` strings."""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]          # strings that end the text (not included in it)
        self.sent = ""                              # text already handed out
        self.stopped = False                        # a stop string was found

    def update(self, token_ids: list[int], is_final: bool) -> str:
        """All tokens so far -> the new text to send. Holds back an incomplete UTF-8 character and a tail that
        may still grow into a stop string, unless this is the final update."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        for stop in self.stop:
            index = text.find(stop, max(0, len(self.sent) - len(stop)))
            if index != -1:
                text = text[:index]
                self.stopped = True
        if not (self.stopped or is_final):
            text = text.rstrip("\ufffd")
            for stop in self.stop:                  # keep back a suffix that is a prefix of a stop string
                for k in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:k]):
                        text = text[:-k]
                        break
        if len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
