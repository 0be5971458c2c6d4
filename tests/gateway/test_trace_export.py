"""Traces -> eval prompts (`qserve gateway export`), and `qserve eval` reading them."""

import json

import pytest

from qserve.evals.runner import EvalError, read_extra_prompts
from qserve.runtime.formats.errors import QserveError
from qserve.runtime.gateway.trace_export import export_prompts

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
                 "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}")


def trace(i, status=200, error=None, request=None):
    return {"id": f"r{i}", "status": status, "error": error, "model": "small",
            "request": request}


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_failed_requests_become_prompts_once_and_textless_traces_are_counted(tmp_path):
    chat = {"messages": [{"role": "user", "content": "What is 2+2?"}]}
    rows = [trace(0, request=chat),
            trace(1, 502, "every attempt failed", chat),              # same prompt again
            trace(2, 200, "the backend failed mid-stream", {"prompt": "Once upon"}),
            trace(3, 422, None, {"prompt": ["A list prompt"]}),
            trace(4, 429, None, None),                                 # zero-retention
            trace(5, 502, None, chat)]
    src, out = tmp_path / "t.jsonl", tmp_path / "p.jsonl"
    write(src, rows)
    n, skipped = export_prompts(str(src), str(out), failed=True)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert (n, skipped) == (3, 1)
    assert [g["id"] for g in got] == ["trace-r1", "trace-r2", "trace-r3"]
    assert got[0]["messages"] == chat["messages"] and got[1]["prompt"] == "Once upon"
    assert got[2]["prompt"] == "A list prompt"
    n, _ = export_prompts(str(src), str(out), sample=1, seed=0)
    assert n == 1 and json.loads(out.read_text())["id"] == "trace-r0"


def test_a_file_that_is_not_a_trace_log_is_refused(tmp_path):
    src = tmp_path / "t.jsonl"
    src.write_text('{"hello": 1}\n')
    with pytest.raises(QserveError, match="is not a gateway trace record"):
        export_prompts(str(src), str(tmp_path / "p.jsonl"), failed=True)


class _Tok:
    def apply_chat_template(self, messages):
        from jinja2 import Template
        return Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)


def test_eval_reads_exported_prompts_rendering_chat_with_the_template(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]})
                 + "\n" + json.dumps({"id": "b", "prompt": "Once upon"}) + "\n")
    assert read_extra_prompts(str(p), _Tok()) == [
        {"id": "extra-a", "prompt": "<s>user: hi</s><s>assistant:"},
        {"id": "extra-b", "prompt": "Once upon"}]
    p.write_text('{"id": "c"}\n')
    with pytest.raises(EvalError, match="needs a 'prompt' string or a 'messages' list"):
        read_extra_prompts(str(p), _Tok())
