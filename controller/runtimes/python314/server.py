"""eddy's python314 runtime: Kyma's new runtime API. A function's handler.py defines `main()`,
which reads the request from Flask's `flask.request` and answers as a Flask view does; gevent's
WSGI server serves it with SERVER_NUMTHREADS greenlets, and the `sdk` module gives the CloudEvent,
event publishing, the tracer and the function's settings (docs/functions.md). The platform's
parts (a warm spare becoming an instance, secrets on stdin, the gateway's instance secret, Secret
mounts read locally) are those of eddy's other Python runtimes (eddy_platform.py).
"""

import hmac
import importlib
import os
import signal
import sys
import traceback
import types
import uuid

# A spare loads its libraries before it waits to become an instance.
import eddy_platform
import flask
import gevent
from gevent import pywsgi

eddy_platform.start()

env = os.environ
function_name = env.get("FUNC_NAME", "")
namespace = env.get("SERVICE_NAMESPACE") or env.get("FUNC_NAMESPACE", "")
runtime = env.get("FUNC_RUNTIME", "python314")
# FUNC_PORT and FUNC_HOST are eddy's (the platform sets them); SERVER_PORT and SERVER_HOST the
# names Kyma's runtime reads.
port = int(env.get("FUNC_PORT") or env.get("SERVER_PORT") or "8080")
host = env.get("FUNC_HOST") or env.get("SERVER_HOST") or "127.0.0.1"
numthreads = int(env.get("SERVER_NUMTHREADS") or "50")
timeout = int(float(env.get("FUNC_TIMEOUT") or "180"))
body_mb_limit = int(env.get("FUNC_BODY_MB_LIMIT") or "100")
function_dir = env.get("HANDLER_PATH") or env.get("FUNC_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "function"
)
module_name = env.get("HANDLER_MOD_NAME") or env.get("MOD_NAME") or "handler"
handler_name = env.get("HANDLER_FUNC_NAME") or env.get("FUNC_HANDLER") or "main"
publisher_address = env.get("PUBLISHER_PROXY_ADDRESS", "")

# The gateway's secret and the publish-only token emit_cloud_event sends, out of the function's
# sight.
instance_secret, publisher_token = eddy_platform.take_secrets()
SECRET_ENVIRON_KEY = eddy_platform.SECRET_ENVIRON_KEY


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


# ---- tracing ------------------------------------------------------------------------------------

from opentelemetry import propagate, trace  # noqa: E402
from opentelemetry.propagators.b3 import B3MultiFormat  # noqa: E402
from opentelemetry.propagators.composite import CompositePropagator  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: E402

# As Kyma's: a tracer provider always, exporting when TRACE_COLLECTOR_ENDPOINT is set, W3C and
# B3 headers read and written, and the `requests` library's calls traced.
tracing_provider = TracerProvider(resource=Resource.create({"service.name": f"{function_name}.{namespace}"}))
if env.get("TRACE_COLLECTOR_ENDPOINT"):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    tracing_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=env["TRACE_COLLECTOR_ENDPOINT"])))
trace.set_tracer_provider(tracing_provider)
propagate.set_global_textmap(CompositePropagator([TraceContextTextMapPropagator(), B3MultiFormat()]))
try:
    from opentelemetry.instrumentation.requests import RequestsInstrumentor

    RequestsInstrumentor().instrument()
except Exception:  # noqa: BLE001 - tracing of outgoing calls is a convenience, never fatal
    log(f"tracing of requests' calls is off:\n{traceback.format_exc()}")
tracer = trace.get_tracer("io.kyma-project.serverless")

# ---- metrics ------------------------------------------------------------------------------------

import prometheus_client  # noqa: E402

calls_total = prometheus_client.Counter("function_calls_total", "Number of calls to user function", ["method"])
failures_total = prometheus_client.Counter(
    "function_failures_total", "Number of exceptions in user function", ["method"]
)
duration_seconds = prometheus_client.Histogram(
    "function_duration_seconds", "Duration of user function in seconds", ["method"]
)

# ---- secret mounts ------------------------------------------------------------------------------

if env.get("EDDY_SECRET_MOUNTS"):
    eddy_platform.install_secret_mounts(env.pop("EDDY_SECRET_MOUNTS"))

# ---- the sdk module -----------------------------------------------------------------------------


def get_cloud_event():
    """The CloudEvent of the request being answered (binary or structured mode), or None when
    it is none."""
    from cloudevents.core.bindings.http import HTTPMessage, from_http_event

    request = flask.request
    content_type = request.content_type or ""
    structured = "application/cloudevents+json" in [part.strip() for part in content_type.split(";")]
    if not structured and not ("ce-type" in request.headers and "ce-source" in request.headers):
        return None
    headers = {name.lower(): utf8_header(value) for name, value in request.headers.items()}
    return from_http_event(HTTPMessage(headers=headers, body=request.get_data()))


def utf8_header(value):
    """A header value as its UTF-8 text: past ASCII it came as raw UTF-8 (a Subscription in
    Kyma's form is delivered so, as CloudEvents' Go SDK writes it), which WSGI reads as
    Latin-1."""
    if value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return value


def emit_cloud_event(type, source, data, optional_attributes=None):  # noqa: A002 - Kyma's name
    """Posts a structured CloudEvent to the event publisher; returns the publisher's answer and
    raises when it is not a 2xx (the event was not stored)."""
    import requests
    from cloudevents.core.bindings.http import to_structured_event
    from cloudevents.core.v1.event import CloudEvent

    if not publisher_address:
        raise RuntimeError("PUBLISHER_PROXY_ADDRESS is not set")
    attributes = {"id": str(uuid.uuid4()), "specversion": "1.0"}
    if data is not None:
        attributes["datacontenttype"] = "text/plain" if isinstance(data, str) else "application/json"
    attributes.update(optional_attributes or {})
    attributes.update({"type": type, "source": source})
    message = to_structured_event(CloudEvent(attributes, data))
    headers = dict(message.headers)
    if publisher_token:
        headers["authorization"] = f"Bearer {publisher_token}"
    answer = requests.post(publisher_address, data=message.body, headers=headers, timeout=timeout)
    answer.raise_for_status()
    return answer


sdk = types.ModuleType("sdk", "Kyma's runtime sdk: the CloudEvent, event publishing, the tracer, settings.")
sdk.get_tracer = lambda: tracer
sdk.get_cloud_event = get_cloud_event
sdk.emit_cloud_event = emit_cloud_event
sdk.get_function_name = lambda: function_name
sdk.get_namespace = lambda: namespace
sdk.get_runtime = lambda: runtime
sdk.get_timeout = lambda: timeout
sdk.get_body_size_limit = lambda: body_mb_limit
# `import sdk` in the handler finds this module, as Kyma's lib/ on sys.path gives it.
sys.modules["sdk"] = sdk

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

# ---- the server ---------------------------------------------------------------------------------

app = flask.Flask(__name__)
app.config["MAX_CONTENT_LENGTH"] = body_mb_limit * 1024 * 1024

METHODS = ["GET", "POST", "PUT", "HEAD", "OPTIONS", "DELETE", "PATCH"]


@app.route("/", defaults={"path": ""}, methods=METHODS)
@app.route("/<path:path>", methods=METHODS)
def call(path=""):
    method = flask.request.method
    calls_total.labels(method).inc()
    if user_function is None:
        failures_total.labels(method).inc()
        return "User function not loaded", 500
    parent = propagate.extract({name.lower(): value for name, value in flask.request.headers.items()})
    name = f"{method} {flask.request.path}"
    with duration_seconds.labels(method).time():
        with tracer.start_as_current_span(name, context=parent, kind=trace.SpanKind.SERVER) as span:
            try:
                with gevent.Timeout(timeout):
                    return user_function()
            except gevent.Timeout:
                failures_total.labels(method).inc()
                log(f"function did not answer within {timeout}s")
                return "Timeout while processing the function", 408
            except Exception as error:
                failures_total.labels(method).inc()
                span.set_status(trace.StatusCode.ERROR, str(error))
                raise


@app.errorhandler(500)
def internal_error(error):
    return "Internal Server Error", 500


@app.get("/favicon.ico")
def favicon():
    return "", 204


@app.get("/healthz")
def healthz():
    return "OK", 200


@app.get("/metrics")
def metrics():
    return (
        prometheus_client.generate_latest(prometheus_client.REGISTRY),
        200,
        {"Content-Type": prometheus_client.CONTENT_TYPE_LATEST},
    )


def from_gateway(wsgi_app):
    """Refuses a call without the instance's secret (locally the gateway sends it)."""
    if not instance_secret:
        return wsgi_app
    refusal = b'{"error": "call this function through the eddy gateway"}'

    def checked(environ, start_response):
        given = environ.pop(SECRET_ENVIRON_KEY, "").encode()
        if not hmac.compare_digest(given, instance_secret):
            start_response("403 Forbidden", [("Content-Type", "application/json")])
            return [refusal]
        return wsgi_app(environ, start_response)

    return checked


def main():
    wsgi_app = app
    if env.get("SERVER_INTERNAL_LOGGER"):
        import logging

        import requestlogger

        wsgi_app = requestlogger.WSGILogger(
            app, [logging.StreamHandler(stream=sys.stdout)], requestlogger.ApacheFormatter()
        )
    server = pywsgi.WSGIServer((host, port), from_gateway(wsgi_app), spawn=numthreads, log=None)

    def shutdown():
        log("Shutting down..")
        server.stop(timeout=10)

    gevent.signal_handler(signal.SIGTERM, shutdown)
    gevent.signal_handler(signal.SIGINT, shutdown)
    server.start()
    log(f"eddy: {function_name} listening on {port}")
    eddy_platform.announce_serving()
    try:
        server.serve_forever()
    finally:
        tracing_provider.shutdown()


if __name__ == "__main__":
    main()
