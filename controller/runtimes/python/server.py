"""eddy's Python runtime (python311, python312): serves a function's handler.py over HTTP with
Kyma Serverless's contract (docs/functions.md). bottle on cheroot serves it, the CloudEvents SDK
reads events, prometheus_client counts calls, and OpenTelemetry traces them; the tracing SDK and
its exporter load only when TRACE_COLLECTOR_ENDPOINT is set.
"""

import hmac
import importlib
import os
import queue
import signal
import sys
import threading
import time
import traceback
import uuid
from urllib.parse import unquote

import bottle
import eddy_platform
from cheroot import wsgi

# Only bottle and cheroot load before the first request is answered. The CloudEvents SDK loads
# with the first CloudEvent, OpenTelemetry with the first traced request (or at start when
# TRACE_COLLECTOR_ENDPOINT is set), prometheus_client once the first call is answered: each
# costs tens of milliseconds of a cold start that a first request need not pay.

if os.environ.get("EDDY_SPARE"):
    # Loaded ahead, where it costs nothing: a spare's first call is often a CloudEvent.
    import cloudevents.http  # noqa: F401
eddy_platform.start()

env = os.environ
function_name = env.get("FUNC_NAME", "")
namespace = env.get("SERVICE_NAMESPACE") or env.get("FUNC_NAMESPACE", "")
runtime = env.get("FUNC_RUNTIME", "")
port = int(env.get("FUNC_PORT", "8080"))
host = env.get("FUNC_HOST", "127.0.0.1")
timeout = float(env.get("FUNC_TIMEOUT", "180"))
function_dir = env.get("FUNC_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "function")
module_name = env.get("MOD_NAME", "handler")
handler_name = env.get("FUNC_HANDLER", "main")
publisher_address = env.get("PUBLISHER_PROXY_ADDRESS", "")
# FUNC_BODY_MB_LIMIT (MiB) is Kyma's current name; FUNC_MEMFILE_MAX (bytes) its older one.
if env.get("FUNC_BODY_MB_LIMIT"):
    bottle.BaseRequest.MEMFILE_MAX = int(env["FUNC_BODY_MB_LIMIT"]) * 1024 * 1024
else:
    bottle.BaseRequest.MEMFILE_MAX = int(env.get("FUNC_MEMFILE_MAX", str(100 * 1024 * 1024)))

# The gateway's secret and the publish-only token emitCloudEvent sends, out of the function's sight.
instance_secret, publisher_token = eddy_platform.take_secrets()
SECRET_ENVIRON_KEY = eddy_platform.SECRET_ENVIRON_KEY


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


# ---- tracing ------------------------------------------------------------------------------------


def start_tracing(endpoint):
    from opentelemetry import propagate, trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.propagators.b3 import B3MultiFormat
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = TracerProvider(resource=Resource.create({"service.name": f"{function_name}.{namespace}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    propagate.set_global_textmap(CompositePropagator([TraceContextTextMapPropagator(), B3MultiFormat()]))
    return provider


tracing_provider = start_tracing(env["TRACE_COLLECTOR_ENDPOINT"]) if env.get("TRACE_COLLECTOR_ENDPOINT") else None
TRACE_HEADERS = ("traceparent", "b3", "x-b3-traceid")


def get_tracer():
    from opentelemetry import trace

    return trace.get_tracer(function_name or "function")


def trace_parent(headers):
    """The incoming trace context, or None when there is none to continue and tracing is off
    (OpenTelemetry then stays unloaded)."""
    if tracing_provider is None and not any(name in headers for name in TRACE_HEADERS):
        return None
    from opentelemetry import propagate

    return propagate.extract({name.lower(): value for name, value in headers.items()})


# ---- metrics ------------------------------------------------------------------------------------


class Metrics:
    """Calls, failures and durations by method, in prometheus_client. It loads a moment after the
    first call is answered (or at the first scrape); calls before that are added when it does."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pending = []
        self.loader = None
        self.prom = None

    def record(self, method, seconds, failed):
        with self.lock:
            if self.prom is None:
                self.pending.append((method, seconds, failed))
                if self.loader is None:
                    self.loader = threading.Timer(0.2, self.load)
                    self.loader.daemon = True
                    self.loader.start()
                return
        self.observe(method, seconds, failed)

    def load(self):
        import prometheus_client

        with self.lock:
            if self.prom is not None:
                return
            self.calls = prometheus_client.Counter("function_calls_total", "Calls of the function.", ["method"])
            self.failures = prometheus_client.Counter("function_failures_total", "Calls that failed.", ["method"])
            self.duration = prometheus_client.Histogram(
                "function_duration_seconds", "Time the function took, in seconds.", ["method"]
            )
            self.prom = prometheus_client
            pending, self.pending = self.pending, []
        for record in pending:
            self.observe(*record)

    def observe(self, method, seconds, failed):
        self.calls.labels(method).inc()
        if failed:
            self.failures.labels(method).inc()
        self.duration.labels(method).observe(seconds)

    def render(self):
        self.load()
        return self.prom.CONTENT_TYPE_LATEST, self.prom.generate_latest(self.prom.REGISTRY)


metrics_recorder = Metrics()

# ---- secret mounts ------------------------------------------------------------------------------

if env.get("EDDY_SECRET_MOUNTS"):
    eddy_platform.install_secret_mounts(env.pop("EDDY_SECRET_MOUNTS"))

# ---- the function -------------------------------------------------------------------------------

sys.path.insert(0, function_dir)
sys.path.insert(1, os.path.join(function_dir, "deps"))
user_function = None
try:
    user_function = getattr(importlib.import_module(module_name), handler_name)
    if not callable(user_function):
        log(f"{module_name}.{handler_name} is not a function")
        user_function = None
except Exception:  # noqa: BLE001 - any failure to load is reported the same way
    log(f"cannot load {module_name}.py:\n{traceback.format_exc()}")

function_context = {
    "function-name": function_name,
    "namespace": namespace,
    "runtime": runtime,
    "timeout": timeout,
    "memory-limit": env.get("FUNC_MEMORY_LIMIT"),
    "body-size-limit": bottle.BaseRequest.MEMFILE_MAX,
}

CE_ATTRIBUTES = ("type", "source", "id", "time", "specversion", "eventtypeversion", "datacontenttype")


def media_type(request):
    """The request's media type, lower case without parameters ("" without a content type)."""
    return request.content_type.split(";")[0].strip().lower()


def is_cloud_event(request, media):
    return media == "application/cloudevents+json" or (
        "ce-type" in request.headers and "ce-source" in request.headers
    )


def header_attribute(value):
    """A binary-mode attribute's value. Past ASCII it came as raw UTF-8 (a Subscription in
    Kyma's form is delivered so, as CloudEvents' Go SDK writes it), which WSGI reads as
    Latin-1: read back as UTF-8. Otherwise percent-decoded (the HTTP binding)."""
    if not isinstance(value, str):
        return value
    if not value.isascii():
        try:
            return value.encode("latin-1").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            return value
    return unquote(value) if "%" in value else value


class Event(dict):
    """What a function receives: a dict (`event['data']`, `event['ce-type']`, …) with Kyma's
    helpers. `event.ceHeaders` is the dict itself."""

    def __init__(self, request, response):
        super().__init__()
        self["extensions"] = {"request": request, "response": response}
        media = media_type(request)
        if media.startswith("multipart/"):
            return
        if is_cloud_event(request, media):
            from cloudevents.http import from_http

            cloud_event = from_http(dict(request.headers), request.body.read())
            binary = "ce-specversion" in request.headers
            for name, value in cloud_event.get_attributes().items():
                if binary:
                    self["ce-" + name] = header_attribute(value)
                else:
                    self["ce-" + name] = unquote(value) if isinstance(value, str) and "%" in value else value
            self["data"] = cloud_event.get_data()
        elif media == "application/json":
            self["data"] = request.json

    @property
    def ceHeaders(self):  # noqa: N802 - Kyma's name
        return self

    @property
    def tracer(self):
        return get_tracer()

    def emitCloudEvent(self, type, source, data, optionalCloudEventAttributes=None):  # noqa: A002,N802,N803
        """Posts a structured CloudEvent to the event publisher; raises on a non-2xx answer."""
        from cloudevents.http import CloudEvent

        attributes = dict(optionalCloudEventAttributes or {})
        attributes.setdefault("id", str(uuid.uuid4()))
        if data is not None and "datacontenttype" not in attributes:
            attributes["datacontenttype"] = "text/plain" if isinstance(data, str) else "application/json"
        attributes.update({"type": type, "source": source})
        post_cloud_event(CloudEvent(attributes, data))

    def publishCloudEvent(self, cloud_event):  # noqa: N802 - Kyma's name, deprecated there
        from cloudevents.http import CloudEvent

        post_cloud_event(cloud_event if isinstance(cloud_event, CloudEvent) else CloudEvent(cloud_event))

    def buildResponseCloudEvent(self, event_id, event_type, data):  # noqa: N802 - Kyma's name
        from cloudevents.http import CloudEvent

        return CloudEvent({"id": event_id, "type": event_type, "source": function_name}, data)


def post_cloud_event(cloud_event):
    if not publisher_address:
        raise RuntimeError("PUBLISHER_PROXY_ADDRESS is not set")
    import requests  # loaded on first use: most functions never emit events
    from cloudevents.conversion import to_structured
    from opentelemetry import propagate

    headers, body = to_structured(cloud_event)
    if publisher_token:
        headers["authorization"] = f"Bearer {publisher_token}"
    propagate.inject(headers)
    requests.post(publisher_address, data=body, headers=headers, timeout=timeout).raise_for_status()


def call_user_function(environ, parent, answer):
    """Runs the function in its own thread, with bottle's request and response bound to it, in a
    span when there is a trace to continue or tracing is on."""
    bottle.request.bind(environ)
    bottle.response.bind()
    if parent is None:
        run_user_function(answer, None)
        return
    from opentelemetry import context as otel_context
    from opentelemetry import trace

    token = otel_context.attach(parent)
    try:
        name = f"{environ['REQUEST_METHOD']} {environ.get('PATH_INFO', '/')}"
        with get_tracer().start_as_current_span(name, kind=trace.SpanKind.SERVER) as span:
            run_user_function(answer, span)
    finally:
        otel_context.detach(token)


def run_user_function(answer, span):
    try:
        event = Event(bottle.request, bottle.response)
    except bottle.HTTPResponse as refusal:  # bottle's own answer: 413 for a body over the limit
        answer.put(("ok", refusal, bottle.response.copy()))
        return
    except Exception as error:  # noqa: BLE001 - a bad CloudEvent is the caller's mistake
        answer.put(("invalid", str(error), None))
        return
    try:
        result = user_function(event, function_context)
        answer.put(("ok", result, bottle.response.copy()))
    except bottle.HTTPResponse as response:
        answer.put(("ok", response, bottle.response.copy()))
    except Exception as error:  # noqa: BLE001 - the function's failure, answered 500
        if span is not None:
            from opentelemetry import trace

            span.set_status(trace.StatusCode.ERROR, str(error))
        log(f"function failed:\n{traceback.format_exc()}")
        answer.put(("failed", error, None))


# ---- the server ---------------------------------------------------------------------------------

app = bottle.Bottle()


@app.hook("before_request")
def from_gateway():
    if not instance_secret:
        return
    given = bottle.request.environ.pop(SECRET_ENVIRON_KEY, "").encode()
    if not hmac.compare_digest(given, instance_secret):
        raise bottle.HTTPResponse('{"error": "call this function through the eddy gateway"}', 403, {"Content-Type": "application/json"})


@app.get("/favicon.ico")
def favicon():
    return bottle.HTTPResponse(status=204)


@app.get("/healthz")
def healthz():
    return "OK"


@app.get("/metrics")
def metrics():
    content_type, text = metrics_recorder.render()
    bottle.response.content_type = content_type
    return text


@app.error(500)
def internal_error(error):
    return "Internal server error"


@app.route("/<:re:.*>", method=["GET", "POST", "PUT", "PATCH", "DELETE"])
def handle():
    method = bottle.request.method
    started = time.perf_counter()
    failed = True
    try:
        value, failed = answer_call()
        return value
    finally:
        metrics_recorder.record(method, time.perf_counter() - started, failed)


def answer_call():
    """The answer and whether it counts as a failure."""
    if user_function is None:
        return bottle.HTTPResponse("User function not loaded", 500, {"Content-Type": "text/plain"}), True
    parent = trace_parent(bottle.request.headers)
    answer = queue.Queue(maxsize=1)
    worker = threading.Thread(
        target=call_user_function, args=(bottle.request.environ, parent, answer), daemon=True
    )
    worker.start()
    try:
        outcome, value, response = answer.get(timeout=timeout)
    except queue.Empty:
        log(f"function did not answer within {timeout:g}s")
        return bottle.HTTPResponse("Timeout while processing the function", 408), True
    if outcome == "invalid":
        return bottle.HTTPResponse(f"invalid CloudEvent: {value}", 400, {"Content-Type": "text/plain"}), False
    if outcome == "failed":
        return bottle.HTTPResponse("Internal server error", 500, {"Content-Type": "text/plain"}), True
    # What the function set on bottle.response in its thread, then bottle's rules for the value.
    bottle.response.status = response.status_line
    for name, header_value in response.headerlist:
        bottle.response.set_header(name, header_value)
    return value, False


def main():
    server = wsgi.Server((host, port), app, numthreads=int(env.get("CHERRYPY_NUMTHREADS", "50")))

    def stop(signum, frame):
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.prepare()
    log(f"eddy: {function_name} listening on {port}")
    eddy_platform.announce_serving()
    try:
        server.serve()
    finally:
        if tracing_provider is not None:
            tracing_provider.shutdown()


if __name__ == "__main__":
    main()
