"""Fuzzing the server's start-up inputs: chat templates (a model folder's, or --chat-template) and model ids with
revisions. A template, however it misbehaves (loops, recursion, floods of output, syntax errors, exceptions,
undefined names), renders or fails with one `ChatTemplateError`/`ValueError` within its time limit; a model id is a
folder, or one `WeightsError`, and never reaches the file system outside the cache's repository folders."""
from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dblock.errors import WeightsError
from dblock.serving.chat import ChatTemplate, ChatTemplateError
from dblock.serving.render_worker import BoundedRenderer

SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
LIMIT_S = 0.5

SNIPPETS = [
    "{{ messages[0]['content'] }}", "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "{% if add_generation_prompt %}assistant:{% endif %}", "{{ eos_token }}", "{{ bos_token }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",      # ~10^10 iterations
    "{% for i in range(100000) %}{% for j in range(1000) %}xxxxxxxxxxxxxxxx{% endfor %}{% endfor %}",   # a flood
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",                                  # unbounded recursion
    "{% macro g(n) %}{% if n > 0 %}{{ g(n - 1) }}{% endif %}x{% endmacro %}{{ g(50) }}",        # bounded recursion
    "{{ raise_exception('refused') }}", "{{ messages[0].content.upper() }}", "{{ undefined_name.attr }}",
    "{{ ''.__class__.__mro__ }}", "{{ 1 / 0 }}", "{% for", "{{ }}", "{% endfor %}", "{{ 'x' * 10**9 }}",
    "{{ messages | tojson }}", "{% set ns = namespace(a=0) %}{% for i in range(100000) %}{% set ns.a = ns.a + 1 %}"
    "{% endfor %}{{ ns.a }}",
]
templates = st.lists(st.sampled_from(SNIPPETS), min_size=1, max_size=3).map("".join)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                           "content": st.one_of(st.text(max_size=12), st.none())}),
                    min_size=1, max_size=3)


@pytest.fixture(scope="module")
def renderer():
    r = BoundedRenderer(ChatTemplate("{{ 1 }}"), time_limit=LIMIT_S, max_chars=5000).start()
    yield r
    r.close()


@settings(max_examples=60, **SETTINGS)
@given(source=templates, msgs=messages)
def test_any_template_renders_or_fails_with_one_error_within_its_limit(renderer, source, msgs):
    try:
        renderer.template = ChatTemplate(source)
    except ValueError as e:                        # a syntax error: one line naming the origin
        assert "not a valid Jinja template" in str(e)
        return
    t0 = time.monotonic()
    try:
        text = renderer.render(msgs)
        assert isinstance(text, str) and len(text) <= 5000
    except ChatTemplateError as e:
        assert str(e)
    assert time.monotonic() - t0 < LIMIT_S + 2.0


ids = st.builds(lambda org, name, rev: f"{org}/{name}" + (f"@{rev}" if rev is not None else ""),
                st.text(alphabet="abcXYZ09._-/\\@ ~%:", min_size=0, max_size=8),
                st.text(alphabet="abcXYZ09._-/\\@ ~%:", min_size=0, max_size=8),
                st.one_of(st.none(), st.text(alphabet="abc09._-/\\@ ~%:\x00\n", max_size=16),
                          st.sampled_from(["..", "../..", "../../x", "main/../../..", "/etc", ".git", "a//b"])))


@settings(max_examples=300, **SETTINGS)
@given(name=ids)
def test_model_ids_are_a_folder_or_one_error_and_no_invalid_revision_reaches_the_cache(name, tmp_path_factory,
                                                                                     monkeypatch):
    """Whatever the id, resolve_model_path returns an existing folder or raises one WeightsError; the cache lookup
    is only ever asked for a valid repository id and a revision without '..', empty or hidden parts."""
    import os

    import huggingface_hub
    from huggingface_hub.utils import validate_repo_id

    from dblock.weights_path import resolve_model_path
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf")))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    asked = []
    real = huggingface_hub.snapshot_download

    def spy(repo_id, revision=None, **kw):
        asked.append((repo_id, revision))
        return real(repo_id, revision=revision, **kw)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    try:
        folder = resolve_model_path(name)
        assert os.path.isdir(folder)
    except WeightsError as e:
        shown = name if name.isprintable() else repr(name)
        assert str(e).startswith(shown) and "\n" not in str(e)       # one line, naming the id
    for repo, rev in asked:
        validate_repo_id(repo)                     # raises on an invalid id
        assert rev is None or (".." not in rev and not rev.startswith(("/", ".")) and "//" not in rev), rev
