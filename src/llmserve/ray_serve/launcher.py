"""``llmserve serve --replicas N``: the server as a Ray Serve application.

Two deployments: ``EngineReplica`` (N of them, or autoscaled on queue depth, each with its
share of CPUs or a GPU as Ray resources, each loading the model once) and ``Ingress`` (the
HTTP app, no CPU reserved). Ray Serve's HTTP proxy listens on --host/--port. Ray, not
llmserve, places, health-checks, restarts and drains replicas.

The first SIGTERM (or Ctrl-C) drains as the single server does, through the ingress: new
requests get 503 while the running ones finish, for up to --shutdown-timeout seconds (a
second signal ends the drain at once); what is left ends with a final error event. Then
the application is deleted, Serve and (if this process started it) the local Ray cluster
shut down, and the exit code is 0.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from typing import Any

from llmserve.config import EngineConfig, ServerConfig
from llmserve.logger import get_logger
from llmserve.ray_serve.config import RayServeConfig

logger = get_logger(__name__)

ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "Ingress"


def build_application(engine_config: EngineConfig, config: ServerConfig,
                      ray_config: RayServeConfig) -> Any:
    """The Ray Serve application (``serve.run`` it, or deploy it on an existing cluster)."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from llmserve.ray_serve.ingress import Ingress
    from llmserve.ray_serve.replica import EngineReplica
    from llmserve.ray_serve.routers import ROUTERS, ROUTING_STATS_PERIOD_S

    router_kwargs = ({"imbalance_threshold": ray_config.imbalance_threshold,
                      "chunk_size": engine_config.cache.block_size,
                      "min_match_tokens": engine_config.cache.block_size}
                     if ray_config.router == "prefix-aware" else {})
    threads = max(1, int(ray_config.cpus_per_replica))
    max_ongoing = ray_config.max_ongoing_requests or (
        engine_config.scheduler.max_num_seqs + (config.max_queued_requests or 1024))
    scaling: dict[str, Any] = {"num_replicas": ray_config.replicas}
    if ray_config.autoscaling:
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=ray_config.min_replicas, max_replicas=ray_config.max_replicas,
            initial_replicas=ray_config.min_replicas,
            target_ongoing_requests=ray_config.target_ongoing_requests,
            upscale_delay_s=ray_config.upscale_delay_s,
            downscale_delay_s=ray_config.downscale_delay_s,
            metrics_interval_s=1.0, look_back_period_s=5.0)}
    engine = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, **scaling,
        max_ongoing_requests=max_ongoing,
        # Beyond what the replicas take, the router holds this many more; then 429.
        max_queued_requests=config.max_queued_requests or -1,
        ray_actor_options={"num_cpus": ray_config.cpus_per_replica,
                           "num_gpus": ray_config.gpus_per_replica,
                           "runtime_env": {"env_vars": {"LLMSERVE_NUM_THREADS": str(threads)}}},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[ray_config.router],
            request_router_kwargs=router_kwargs,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=10.0),
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=config.shutdown_timeout)
    ingress = serve.deployment(
        serve.ingress()(Ingress), name=INGRESS_DEPLOYMENT, num_replicas=1,
        max_ongoing_requests=100_000,  # admission is the app's (429) and the replicas'
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=config.shutdown_timeout + 5)
    return ingress.bind(engine.bind(engine_config, config), engine_config, config)


def app_builder(args: dict[str, Any]) -> Any:
    """The application for Ray Serve's config files (``serve run``/``serve deploy``, a
    KubeRay RayService): ``import_path: llmserve.ray_serve.launcher:app_builder`` with
    ``args`` holding ``llmserve serve`` options by name, e.g. ``{"model":
    "smollm2-135m-instruct", "replicas": 2, "router": "prefix-aware", "no-database":
    true}`` (true: a flag). Host and port are Serve's own (http_options) there."""
    from llmserve.cli import serve_configs

    argv = serve_argv(args)
    if not {"host", "allowed-hosts", "allowed_hosts"} & set(args):
        argv += ["--allowed-hosts", "*"]  # Serve's proxy listens where http_options say
    engine_config, config, ray_config = serve_configs(argv)
    if ray_config is None:
        ray_config = RayServeConfig()
    return build_application(engine_config, config, ray_config)


def serve_argv(args: dict[str, Any]) -> list[str]:
    """The ``llmserve serve`` command line of a Serve application's ``args``: each name as
    an option (underscores as dashes); true: a flag; false or null: left out."""
    argv: list[str] = []
    for name, value in args.items():
        option = "--" + str(name).replace("_", "-")
        if value is True:
            argv.append(option)
        elif value not in (False, None):
            argv += [option, str(value)]
    return argv


def start(engine_config: EngineConfig, config: ServerConfig,
          ray_config: RayServeConfig) -> None:
    """Connect to (or start) Ray, start Serve's HTTP proxy on --host/--port, and deploy;
    returns when every replica is ready."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        _connect(ray_config)
    serve.start(http_options={"host": config.host, "port": config.port})
    if ray_config.address is not None:
        logger.info("on the existing Ray cluster at %s the application is served by its "
                    "Serve HTTP proxy (--host/--port apply only if Serve was not running "
                    "there yet)", ray_config.address)
    began = time.monotonic()
    serve.run(build_application(engine_config, config, ray_config),
              name=ray_config.app_name, route_prefix="/", blocking=False)
    logger.info("serving %s on http://%s:%d with %s engine replicas on Ray (router %s); "
                "ready after %.1f s", config.served_model_name or engine_config.model.model,
                config.host, config.port,
                (f"{ray_config.min_replicas}-{ray_config.max_replicas} autoscaled"
                 if ray_config.autoscaling else ray_config.replicas),
                ray_config.router, time.monotonic() - began)


def drain(ray_config: RayServeConfig, timeout: float, hurry: threading.Event) -> None:
    """The single server's drain, by the ingress: new requests get 503 (shutting down)
    while the running ones finish, for up to ``timeout`` seconds or until ``hurry`` (a
    second signal); what is left then ends with the final error event "the server is
    shutting down". The application is deleted only after this, since Ray's proxy answers
    404 for a deleted application's routes."""
    from ray import serve

    try:
        ingress = serve.get_app_handle(ray_config.app_name)
        running = ingress.begin_drain.remote().result(timeout_s=30)
        logger.info("shutdown requested: draining %d requests (up to %.0f s; a second "
                    "signal ends the drain now)", running, timeout)
        deadline = time.monotonic() + timeout
        while (running and time.monotonic() < deadline and not hurry.is_set()):
            hurry.wait(0.25)
            running = ingress.unfinished.remote().result(timeout_s=30)
        if running:
            ended = ingress.end_requests.remote().result(timeout_s=30)
            logger.info("ended %d requests with an error", ended)
    except Exception as e:  # the application is gone or broken: deletion still follows
        logger.warning("draining through the ingress failed (%s: %s); deleting the "
                       "application", type(e).__name__, e)


def stop(ray_config: RayServeConfig) -> None:
    """Remove the application; then stop Serve and the local Ray cluster if this process
    started them (an existing cluster keeps its other applications)."""
    import ray
    from ray import serve

    serve.delete(ray_config.app_name)  # replicas finish what they still hold, then stop
    if ray_config.address is None:
        serve.shutdown()
    ray.shutdown()  # a local cluster stops; a connection to an existing one closes


def check_cluster_resources(available: dict[str, float], ray_config: RayServeConfig) -> None:
    """The Ray cluster (``ray.cluster_resources()``) holds what the replicas started at
    deployment ask for, else a ValueError that says what is missing: Ray would otherwise
    wait for it without a word, forever (the ingress reserves no CPU)."""
    replicas = ray_config.min_replicas if ray_config.autoscaling else ray_config.replicas
    assert replicas is not None
    missing = []
    for resource, flag, each in (("CPU", "--cpus-per-replica", ray_config.cpus_per_replica),
                                 ("GPU", "--gpus-per-replica", ray_config.gpus_per_replica)):
        need = replicas * each
        have = float(available.get(resource, 0.0))
        if need > have + 1e-9:
            missing.append(f"{need:g} {resource}s ({replicas} replicas x {flag} {each:g}) "
                           f"but the cluster has {have:g}")
    if missing:
        raise ValueError("the Ray cluster cannot place the engine replicas: they need "
                         + "; and ".join(missing)
                         + "; lower --replicas or the per-replica resources, or add nodes "
                           "to the cluster (--ray-address)")


def _check_chat_template(engine_config: EngineConfig, config: ServerConfig, *,
                         local: bool) -> ServerConfig:
    """The chat template parses, as the single server checks at start: --chat-template's
    (read here, on the driver: the config the replicas get holds its text, not a path), and
    on a local cluster the model's own (another cluster's nodes may hold files this one
    lacks)."""
    from llmserve.models.loader import load_tokenizer
    from llmserve.server.launcher import use_chat_template
    from llmserve.tokenizer.chat_template import read_chat_template

    model = engine_config.model.model
    if config.chat_template is not None:
        config = dataclasses.replace(config,
                                     chat_template=read_chat_template(config.chat_template))
    if local or config.chat_template is not None:
        use_chat_template(load_tokenizer(model), config.chat_template, model)
    return config


def _connect(ray_config: RayServeConfig) -> None:
    """Start a local Ray cluster of our own (never join one found on the machine unless
    --ray-address says so), or connect to the given one."""
    import ray

    if ray_config.address is None:
        # Ray runs its workers at nice 15 by default, below everything else on the node;
        # here the workers (the replicas and their engines) are the point of the cluster.
        os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address=ray_config.address or "local", include_dashboard=False,
             log_to_driver=False, configure_logging=False)


def serve_on_ray(engine_config: EngineConfig, config: ServerConfig,
                 ray_config: RayServeConfig) -> int:
    stop_requested = threading.Event()
    hurry = threading.Event()  # a second signal: end the drain now, still cleanly

    def on_signal(sig: int, frame: Any) -> None:
        if stop_requested.is_set():
            logger.info("second signal: ending the running requests now")
            hurry.set()
            return
        stop_requested.set()

    # Ray installs its own SIGTERM handler when it starts; ours replaces it, and it is in
    # place before the deployment starts (a signal during start-up drains once it is up).
    config = _check_chat_template(engine_config, config, local=ray_config.address is None)
    _connect(ray_config)
    try:
        import ray

        try:
            check_cluster_resources(ray.cluster_resources(), ray_config)
        except ValueError as e:
            if ray_config.address is None:
                raise
            # An existing cluster may add nodes on demand (its autoscaler): only a warning.
            logger.warning("%s", e)
    except BaseException:
        ray.shutdown()  # a local cluster stops: nothing is left behind
        raise
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        start(engine_config, config, ray_config)
        stop_requested.wait()
        drain(ray_config, config.shutdown_timeout, hurry)
        stop(ray_config)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
