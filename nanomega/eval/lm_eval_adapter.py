"""A nanomega checkpoint as an lm-evaluation-harness model, so any lm-eval task runs on it without conversion.

    python -m nanomega.eval.lm_eval_adapter --model nanomega --model_args run=runs/x --tasks hellaswag
    python -m nanomega.eval.lm_eval_adapter --model nanomega --model_args run=runs/x,dtype=bfloat16 \\
        --tasks my_task --include_path my_tasks/ --device cuda --batch_size 32

lm-eval finds models only in its own registry (lm_eval.models' table; no package entry points), so a plain
`lm_eval --model nanomega` cannot see this one. `python -m nanomega.eval.lm_eval_adapter ARGS` registers the model
under the name "nanomega" (importing this module does) and hands ARGS to lm-eval's own command line, which
takes every flag it documents. From Python, import this module and call lm_eval.simple_evaluate(model="nanomega",
model_args={"run": ...}).

model_args: run (a run directory, its latest checkpoint, or a checkpoint directory), dtype (autocast:
float32 or bfloat16), max_gen_toks (generate_until's default, 256 as lm-eval's HFLM). --device and
--batch_size are lm-eval's own flags.

Log-likelihoods are nanomega.eval.evaluate.score_pairs, the scorer --eval.tasks uses during training; tokens follow
lm-eval's TemplateLM (context + continuation encoded whole, an empty context is the EOS token). Generation is
greedy and one request at a time with nanomega.eval.generate.sample (its KV cache), up
to max_gen_toks tokens or the first stop string (`until`) or the EOS token; the context loses tokens from the
left to leave max_gen_toks positions, as HFLM's does. One process: requests are not split over ranks.
"""
from __future__ import annotations

import sys

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from nanomega.eval.evaluate import load_run, prefix_id, score_pairs
from nanomega.eval.generate import sample
from nanomega.train.step import autocast


@register_model("nanomega")
class NanomegaLM(TemplateLM):
    def __init__(self, run: str, device: str | None = None, batch_size=16, max_batch_size=None,
                 dtype: str = "float32", max_gen_toks: int = 256):
        super().__init__()
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"model_args dtype={dtype!r} is not one of float32, bfloat16")
        if str(batch_size).startswith("auto"):     # lm-eval's "auto" measures the largest batch that fits
            raise ValueError("--batch_size auto is not supported by the nanomega model; give a number")
        name = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._device = torch.device(name)
        self.params, self.cfg, self.tokenizer, self.checkpoint = load_run(run, self._device)
        self.batch_size, self.dtype, self.max_gen_toks = int(batch_size), dtype, int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return prefix_id(self.tokenizer)       # EOS, else BOS: what an empty context and rolling windows start with

    @property
    def max_length(self) -> int:
        return self.cfg.model.max_seq_len

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)      # no special tokens: nanomega's tokenizers add none

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = score_pairs(self.params, self.cfg.model, [(ctx, cont) for _, ctx, cont in requests],
                              self._device, self.batch_size, self.dtype)
        for (key, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's log-likelihood after the EOS token, in windows of the model's length that predict
        every token once (lm-eval's rolling windows, each with as much context as fits)."""
        out = []
        for (text,) in [req.args for req in requests]:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(s for s, _ in score_pairs(self.params, self.cfg.model, windows, self._device,
                                                   self.batch_size, self.dtype))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    @torch.no_grad()
    def greedy(self, context: str, until: list[str], max_gen_toks: int) -> str:
        """The greedy continuation of `context`, cut before the first stop string."""
        ids = self.tok_encode(context) or [self.eot_token_id]
        ids = ids[-max(1, self.max_length - max_gen_toks):]
        eos = self.tokenizer.eos_id

        def done(new: torch.Tensor) -> bool:       # after each token: the EOS, or a stop string in the text
            ids = new[0].tolist()
            return ids[-1] == eos or any(stop in self.tok_decode(ids) for stop in until)

        with autocast(self.dtype, self._device):
            out = sample(self.params, self.cfg.model, torch.tensor([ids], device=self._device), max_gen_toks,
                         temperature=0, stop=done)
        new = out[0, len(ids):].tolist()
        new = new[:-1] if new and new[-1] == eos else new
        text = self.tok_decode(new)
        for stop in until:
            text = text.split(stop)[0]
        return text

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in [req.args for req in requests]:
            kwargs = dict(gen_kwargs)
            if kwargs.pop("do_sample", False) or kwargs.get("temperature", 0.0) > 0:
                raise ValueError("the nanomega model generates greedily only; the task asks for sampling "
                                 f"({gen_kwargs}): set do_sample=false / temperature=0 in its generation_kwargs")
            until = kwargs.get("until", [])
            until = [until] if isinstance(until, str) else list(until)
            text = self.greedy(context, until, int(kwargs.get("max_gen_toks", self.max_gen_toks)))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def main() -> None:
    """lm-eval's command line, with the nanomega model registered (module docstring)."""
    from lm_eval.__main__ import cli_evaluate
    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
