"""One benchmark from start to report: workload, then one load run per concurrency."""

from __future__ import annotations

import datetime
import math
from dataclasses import asdict, dataclass, field

from .client import ClientConfig, resolve_model
from .errors import BenchmarkError
from .load_generator import LoadConfig, run_load
from .metrics import DEFAULT_PERCENTILES, compute_metrics
from .prompt_tokenizer import PromptTokenizer, open_tokenizer
from .report import BenchmarkReport, RunRecord
from .workloads import PromptBuilder, WorkloadParams, load_corpus, make_workload


@dataclass
class BenchConfig:
    endpoint: str  # server root or its /v1 URL
    workload: str = "random"
    params: WorkloadParams = field(default_factory=WorkloadParams)
    concurrencies: tuple[int | None, ...] = (None,)  # one run per entry (a sweep)
    request_rate: float = math.inf
    max_duration: float | None = None
    model: str | None = None
    api: str = "completions"
    api_key: str | None = None
    temperature: float = 0.0
    tokenizer: str | None = None  # local tokenizer spec; None: the server's /tokenize
    corpus: str | None = None
    slos_ms: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    request_timeout: float = 600.0
    progress: bool = True


def base_url(endpoint: str) -> str:
    """`http://host:port` from `http://host:port[/v1][/]`."""
    url = endpoint.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BenchmarkError(f"--endpoint {endpoint!r} must be an http:// URL, "
                             "e.g. http://127.0.0.1:8000")
    return url[:-3] if url.endswith("/v1") else url


def run_benchmark(cfg: BenchConfig, tokenizer: PromptTokenizer | None = None) -> BenchmarkReport:
    base = base_url(cfg.endpoint)
    model = resolve_model(base, cfg.model, cfg.api_key)
    tok = tokenizer or open_tokenizer(base, model, cfg.tokenizer)
    specs = make_workload(cfg.workload, cfg.params, PromptBuilder(tok, load_corpus(cfg.corpus)))
    client = ClientConfig(base, model, cfg.api, cfg.temperature, cfg.api_key,
                          cfg.request_timeout)
    runs = []
    for conc in cfg.concurrencies:
        load = LoadConfig(conc, cfg.request_rate, cfg.max_duration, cfg.params.seed,
                          cfg.progress)
        done = run_load(specs, client, load)
        metrics = compute_metrics(done.results, done.duration, done.skipped, cfg.slos_ms,
                                  cfg.percentiles)
        runs.append(RunRecord(conc, cfg.request_rate, metrics, done.results))
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    params = asdict(cfg.params)
    params["prefix_tokens_shared"] = min((s.prefix_len for s in specs), default=0)
    return BenchmarkReport(date, base, model, cfg.api, cfg.workload, params, tok.name, runs)
