"""Incremental detokenization with stop strings, on a toy tokenizer (one string per token id)."""
from tierllm.server.text import TextStream


class ToyTokenizer:
    vocab = {0: "Hel", 1: "lo", 2: " wor", 3: "ld", 4: "!", 5: " E", 6: "ND", 7: " more"}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[i] for i in ids)


def _run(ids, stop):
    stream, out = TextStream(ToyTokenizer(), stop), []
    for n in range(1, len(ids) + 1):
        out.append(stream.update(ids[:n], is_final=n == len(ids)))
        if stream.stopped:
            break
    return out, stream


def test_deltas_concatenate_to_the_full_text():
    out, stream = _run([0, 1, 2, 3, 4], [])
    assert "".join(out) == "Hello world!" and not stream.stopped


def test_stop_string_across_tokens_is_cut_and_never_sent():
    out, stream = _run([0, 1, 5, 6, 7], [" END"])
    assert "".join(out) == "Hello" and stream.stopped
    assert all("E" not in piece for piece in out)          # the partial " E" was held back, then dropped


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop():
    out, stream = _run([0, 1, 5, 4], [" END"])
    assert "".join(out) == "Hello E!" and not stream.stopped
