// The `sdk` module of Kyma's new runtime API (nodejs26): what a function imports to read the
// CloudEvent it was called with, emit events, get the tracer and read its own settings. The
// server configures it; this module only asks the server (through a global the server sets),
// so a function's `require("sdk")` and `import "sdk"` see the same runtime whichever copy of
// this file they load.
"use strict";

const runtime = () => {
  const server = globalThis[Symbol.for("eddy.runtime")];
  if (!server) throw new Error("the sdk module works only inside eddy's Node.js runtime");
  return server;
};

/** The OpenTelemetry tracer of the function. */
function getTracer() {
  return runtime().tracer;
}
/** The CloudEvent of an Express request (binary or structured mode), or null when it is none. */
function getCloudEvent(req) {
  return runtime().getCloudEvent(req);
}
/** Posts a CloudEvent to the event publisher; resolves to axios's response. */
function emitCloudEvent(type, source, data, optionalAttributes) {
  return runtime().emitCloudEvent(type, source, data, optionalAttributes);
}
function getFunctionName() {
  return runtime().functionName;
}
function getNamespace() {
  return runtime().namespace;
}
function getRuntime() {
  return runtime().runtime;
}
/** The function's timeout, in seconds. */
function getTimeout() {
  return runtime().timeoutSeconds;
}
/** The largest request body, in MB. */
function getBodySizeLimit() {
  return runtime().bodyLimitMb;
}

// Shorthand properties only: Node.js then sees them as named exports for `import { … } from "sdk"`.
module.exports = {
  getTracer,
  getCloudEvent,
  emitCloudEvent,
  getFunctionName,
  getNamespace,
  getRuntime,
  getTimeout,
  getBodySizeLimit,
};
