// Publishes events to an eddy event-bus with the official CloudEvents JavaScript SDK.
//
// Usage: node publish_node.mjs BUS_URL RUN_ID
//
// Sends one binary-mode and one structured-mode event and prints, as JSON, what each event holds
// so that the calling test can compare it with what JetStream stored.
import { CloudEvent, HTTP } from "cloudevents";

const [bus, run] = process.argv.slice(2);

const events = [
  [
    "binary",
    HTTP.binary,
    new CloudEvent({
      id: `js-binary-${run}`,
      source: "https://shop.example/node",
      type: "order.created.v1",
      time: "2024-05-01T08:30:15.250Z",
      subject: "orders/44",
      dataschema: "https://schemas.example/order.json",
      datacontenttype: "application/json",
      tenant: "acme",
      priority: 7,
      data: { sku: "C-3", qty: 5 },
    }),
  ],
  [
    "structured",
    HTTP.structured,
    new CloudEvent({
      id: `js-structured-${run}`,
      source: "https://shop.example/node",
      type: "order.created.v1",
      subject: "orders/45",
      datacontenttype: "application/json",
      tenant: "acme",
      priority: 3,
      urgent: true,
      data: { sku: "D-4", qty: 1 },
    }),
  ],
];

const sent = [];
for (const [mode, encode, event] of events) {
  const message = encode(event);
  const response = await fetch(`${bus}/publish`, {
    method: "POST",
    headers: message.headers,
    body: message.body,
  });
  if (response.status !== 204) {
    console.error(`event-bus answered ${response.status}: ${await response.text()}`);
    process.exit(1);
  }
  const { data, data_base64, ...attributes } = event.toJSON();
  for (const [name, value] of Object.entries(attributes)) {
    if (value === undefined || value === null) delete attributes[name];
    else attributes[name] = String(value);
  }
  sent.push({ mode, attributes, data });
}
console.log(JSON.stringify(sent));
