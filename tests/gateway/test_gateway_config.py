"""The gateway config: what it accepts, and that every mistake names its key."""

import pytest

from qserve.runtime.gateway.config import ConfigError, load_config, parse_config

ENV = {"SMALL_KEY": "sk-small", "TEAM_KEY": "sk-team"}


def base(**extra):
    cfg = {"backends": [{"name": "a", "url": "http://127.0.0.1:9001/v1", "models": ["m"]},
                        {"name": "b", "url": "http://127.0.0.1:9002", "models": ["m", "big"],
                         "weight": 2, "api_key_env": "SMALL_KEY"}],
           "groups": [{"name": "small", "backends": ["a", "b"], "model": "m",
                       "aliases": ["fast"], "fallbacks": ["large"]},
                      {"name": "large", "backends": ["b"], "model": "big"}]}
    cfg.update(extra)
    return cfg


def test_a_full_config_parses_into_its_dataclasses():
    cfg = parse_config(base(routing={"auto": {"small": "small", "large": "large",
                                              "threshold": 0.3}},
                            keys=[{"name": "team", "key_env": "TEAM_KEY", "models": ["fast"],
                                   "limits": {"requests_per_minute": 10}}],
                            retries={"max_attempts": 2}, cache={"enabled": True}), ENV)
    assert cfg.backends[0].url == "http://127.0.0.1:9001"       # /v1 dropped
    assert cfg.backends[1].api_key == "sk-small" and cfg.backends[1].weight == 2.0
    assert cfg.group_names() == {"small": "small", "fast": "small", "large": "large"}
    assert cfg.auto.threshold == 0.3 and cfg.auto.small == "small"
    assert cfg.keys[0].key == "sk-team" and cfg.keys[0].models == ("fast",)
    assert cfg.keys[0].limits.requests_per_minute == 10
    assert cfg.keys[0].limits.tokens_per_minute is None
    assert cfg.retries.max_attempts == 2 and cfg.cache.enabled


def test_without_groups_each_model_is_a_group_of_the_backends_serving_it():
    cfg = parse_config({"backends": base()["backends"]}, ENV)
    assert [(g.name, g.backends, g.model) for g in cfg.groups] == [
        ("m", ("a", "b"), "m"), ("big", ("b",), "big")]


@pytest.mark.parametrize("mutate, where", [
    (lambda c: c.update(backend=[]), "config.backend: unknown key"),
    (lambda c: c["backends"][1].update(weigth=1), "backends[1].weigth: unknown key"),
    (lambda c: c["backends"][0].update(url="localhost:9001"), "backends[0].url: expected"),
    (lambda c: c["backends"][0].update(timeouts={"first_token": -1}),
     "backends[0].timeouts.first_token: must be > 0"),
    (lambda c: c["backends"][0].update(max_concurrency="8"),
     "backends[0].max_concurrency: expected an integer"),
    (lambda c: c["backends"][0].pop("models"), "backends[0].models: required key"),
    (lambda c: c["backends"][1].update(name="a"), "backends: the backend name 'a' appears twice"),
    (lambda c: c["backends"][0].update(api_key_env="NOPE"),
     "backends[0].api_key_env: the environment variable NOPE is not set"),
    (lambda c: c["groups"][0].update(backends=["a", "zz"]), "groups[0].backends: no backend"),
    (lambda c: c["groups"][1].update(model="m2"), "groups[1].model: backend 'b' does not list"),
    (lambda c: c["groups"][0].update(fallbacks=["small"]), "groups[0].fallbacks: 'small' is"),
    (lambda c: c["groups"][1].update(aliases=["fast"]), "groups: the model name or alias 'fast'"),
    (lambda c: c["groups"][1].update(aliases=["auto"]), "groups: 'auto' is reserved"),
    (lambda c: c.update(routing={"auto": {"small": "small"}}), "routing.auto.large: required"),
    (lambda c: c.update(routing={"auto": {"small": "s", "large": "large"}}),
     "routing.auto.small: 's' is not a group"),
    (lambda c: c.update(routing={"auto": {"small": "small", "large": "large", "threshold": 2}}),
     "routing.auto.threshold: must be <= 1"),
    (lambda c: c.update(keys=[{"name": "k", "key_env": "TEAM_KEY", "models": ["nope"]}]),
     "keys[0].models: 'nope' is not a group"),
    (lambda c: c.update(keys=[{"name": "k", "key_env": "TEAM_KEY",
                               "limits": {"requests_per_minute": 0}}]),
     "keys[0].limits.requests_per_minute: must be >= 1"),
    (lambda c: c.update(cache={"enabled": "yes"}), "cache.enabled: expected true or false"),
    (lambda c: c.update(cache={"enabled": True}, trace={"zero_retention": True}),
     "cache.enabled: the response cache keeps completion text"),
    (lambda c: c.update(trace={"sample": 1.5}), "trace.sample: must be <= 1"),
    (lambda c: c.update(guardrails={"input": {"emial": "mask"}}), "guardrails.input.emial"),
])
def test_each_mistake_is_refused_naming_its_key(mutate, where):
    cfg = base()
    mutate(cfg)
    with pytest.raises(ConfigError) as e:
        parse_config(cfg, ENV)
    assert where in str(e.value)


def test_a_file_that_is_not_yaml_or_missing_is_refused(tmp_path):
    bad = tmp_path / "g.yaml"
    bad.write_text("backends: [\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="cannot read the gateway config"):
        load_config(str(tmp_path / "missing.yaml"))


def test_the_command_refuses_to_start_on_an_invalid_config_naming_the_key(tmp_path):
    from click.testing import CliRunner

    from qserve.runtime.cli import main

    bad = tmp_path / "g.yaml"
    bad.write_text("backends:\n  - {name: a, url: http://127.0.0.1:9, models: [m], "
                   "max_concurency: 4}\n")
    res = CliRunner().invoke(main, ["gateway", "--config", str(bad)])
    assert res.exit_code == 2
    assert "invalid gateway config: backends[0].max_concurency: unknown key" in res.output
    res = CliRunner().invoke(main, ["gateway"])
    assert res.exit_code == 2 and "give the config" in res.output


def test_the_gateway_does_not_load_the_engine_or_torch():
    import subprocess
    import sys

    code = ("import sys, qserve.runtime.gateway.app, qserve.runtime.gateway.command; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
