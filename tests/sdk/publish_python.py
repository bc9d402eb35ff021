"""Publishes events to an eddy event-bus with the official CloudEvents Python SDK.

Usage: publish_python.py BUS_URL RUN_ID

Sends one binary-mode and one structured-mode event and prints, as JSON, what each event holds
so that the calling test can compare it with what JetStream stored.
"""

import json
import sys
import urllib.request
from datetime import datetime, timezone

from cloudevents.core.bindings.http import to_binary, to_structured
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent


def canonical(value):
    """The CloudEvents canonical string form of an attribute value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def send(bus, message):
    request = urllib.request.Request(
        bus + "/publish", data=message.body, headers=message.headers, method="POST"
    )
    with urllib.request.urlopen(request) as response:
        if response.status != 204:
            raise SystemExit(f"event-bus answered {response.status}")


def main():
    bus, run = sys.argv[1], sys.argv[2]
    time = datetime(2024, 5, 1, 8, 30, 15, 250000, tzinfo=timezone.utc)
    events = [
        (
            "binary",
            to_binary,
            CloudEvent(
                attributes={
                    "id": f"py-binary-{run}",
                    "source": "https://shop.example/python",
                    "type": "order.created.v1",
                    "time": time,
                    "subject": "orders/42 (gift) 100% ünïcode",
                    "dataschema": "https://schemas.example/order.json",
                    "datacontenttype": "application/json",
                    "tenant": "acme corp",
                    "priority": 7,
                },
                data={"sku": "A-1", "qty": 2, "note": "ünïcode"},
            ),
        ),
        (
            "structured",
            to_structured,
            CloudEvent(
                attributes={
                    "id": f"py-structured-{run}",
                    "source": "https://shop.example/python",
                    "type": "order.created.v1",
                    "time": time,
                    "subject": "orders/43",
                    "datacontenttype": "application/json",
                    "tenant": "acme",
                    "priority": 3,
                    "urgent": True,
                },
                data={"sku": "B-2", "qty": 1},
            ),
        ),
    ]
    sent = []
    for mode, encode, event in events:
        send(bus, encode(event, JSONFormat()))
        attributes = {
            name: canonical(value)
            for name, value in event.get_attributes().items()
            if value is not None
        }
        sent.append({"mode": mode, "attributes": attributes, "data": event.get_data()})
    print(json.dumps(sent))


if __name__ == "__main__":
    main()
