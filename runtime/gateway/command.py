"""`qserve gateway`: run the gateway, or export its traces as eval prompts.

    qserve gateway --config gateway.yaml [--host 127.0.0.1] [--port 8080]
    qserve gateway export TRACES.jsonl --failed|--sample N --out prompts.jsonl
"""

from __future__ import annotations

import click

from ..formats.errors import QserveError


@click.group(name="gateway", invoke_without_command=True)
@click.option("--config", "config_path", default=None, metavar="FILE",
              help="The gateway's YAML config (backends, groups, keys, guardrails, ...).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.pass_context
def gateway(ctx, config_path, host, port, log_level):
    """OpenAI-compatible LLM gateway in front of OpenAI-compatible servers: routing,
    fallbacks, rate limits, PII guardrails, cache, traces. SIGHUP reloads the config."""
    if ctx.invoked_subcommand is not None:
        return
    if config_path is None:
        raise click.UsageError("give the config: qserve gateway --config gateway.yaml")
    import logging
    import signal

    import uvicorn

    from .app import create_gateway_app
    from .config import ConfigError, load_config
    from .state import GatewayState

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from .. import telemetry

    telemetry.configure("qserve-gateway")  # on only where the OTEL_* variables ask for it
    try:
        config = load_config(config_path)
    except ConfigError as e:
        raise click.ClickException(f"invalid gateway config: {e}") from None
    app = create_gateway_app(GatewayState(config, config_path))
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"qserve gateway: {len(config.backends)} backends, {len(config.groups)} model "
               f"groups{', auto routing' if config.auto else ''}"
               f"{', API keys required' if config.keys else ''}; serving at "
               f"http://{shown}:{port}/v1", err=True)
    # no access log (every request has a trace line) and no forwarded-address rewriting
    # (the gateway never uses the client's address): both cost time on every request
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           access_log=False, proxy_headers=False,
                                           timeout_graceful_shutdown=30))
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again for
    # the handler it found: with the default one the process died of it (exit 143) after a
    # clean stop. A handler that does nothing lets the command return (exit 0), as serve's.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT,
                                                                     signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise click.ClickException(f"the gateway did not start on {host}:{port} (its error is "
                                   f"above); is the port in use? Pick another with --port.")


@gateway.command(name="export")
@click.argument("traces", type=click.Path(exists=True, dir_okay=False))
@click.option("--failed", is_flag=True, help="Requests that failed (status not 200, errors).")
@click.option("--sample", type=click.IntRange(min=1), default=None,
              help="A random sample of N successful requests.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out_path", required=True, help="The prompts file to write (JSONL).")
def export(traces, failed, sample, seed, out_path):
    """Turn gateway traces into an eval prompts file (`qserve eval --prompts FILE`)."""
    from .trace_export import export_prompts

    if failed == (sample is not None):
        raise click.UsageError("give exactly one of --failed and --sample N.")
    try:
        n, skipped = export_prompts(traces, out_path, failed=failed, sample=sample, seed=seed)
    except QserveError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {n} prompts to {out_path}"
               + (f" ({skipped} traces had no text: zero-retention or refused early)"
                  if skipped else ""), err=True)
