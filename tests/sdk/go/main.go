// Command eddy-sdk-go publishes to eddy and receives from it with CloudEvents' Go SDK, the
// SDK Kyma's publisher proxy and dispatcher are built on (used by eddy's tests/go_sdk.rs).
//
//	eddy-sdk-go publish BUS_URL RUN_ID   sends three events (binary 1.0, structured 1.0, binary 0.3)
//	                                     and prints them as a JSON array
//	eddy-sdk-go sink                     listens on a free loopback port, prints "listening PORT",
//	                                     then one JSON line per event received
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"

	cloudevents "github.com/cloudevents/sdk-go/v2"
	"github.com/cloudevents/sdk-go/v2/binding"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"
)

// What the tests compare: the attributes as the SDK reads them.
type seen struct {
	SpecVersion  string `json:"specversion"`
	ID           string `json:"id"`
	Source       string `json:"source"`
	Type         string `json:"type"`
	Subject      string `json:"subject"`
	DataSchema   string `json:"dataschema"`
	OriginalType string `json:"originaltype"`
	Tenant       string `json:"tenant"`
	Data         string `json:"data"`
}

func describe(event cloudevents.Event) seen {
	extension := func(name string) string {
		if value, ok := event.Extensions()[name]; ok {
			return fmt.Sprint(value)
		}
		return ""
	}
	return seen{
		SpecVersion:  event.SpecVersion(),
		ID:           event.ID(),
		Source:       event.Source(),
		Type:         event.Type(),
		Subject:      event.Subject(),
		DataSchema:   event.DataSchema(),
		OriginalType: extension("originaltype"),
		Tenant:       extension("tenant"),
		Data:         string(event.Data()),
	}
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, format+"\n", args...)
	os.Exit(1)
}

func publish(url, run string) {
	client, err := cloudevents.NewClientHTTP(cloudevents.WithTarget(url + "/publish"))
	if err != nil {
		fail("client: %v", err)
	}
	var sent []seen
	for _, form := range []struct {
		name     string
		version  string
		encoding binding.Encoding
	}{
		{"binary", cloudevents.VersionV1, binding.EncodingBinary},
		{"structured", cloudevents.VersionV1, binding.EncodingStructured},
		{"v03", cloudevents.VersionV03, binding.EncodingBinary},
	} {
		event := cloudevents.NewEvent(form.version)
		event.SetID("go-" + form.name + "-" + run)
		event.SetSource("commerce")
		event.SetType("order.créée.v1")
		event.SetSubject("100% über")
		event.SetExtension("tenant", "ä b")
		event.SetDataSchema("https://schemas.example/commande")
		if err := event.SetData(cloudevents.ApplicationJSON, map[string]string{"mode": form.name}); err != nil {
			fail("data: %v", err)
		}
		ctx := context.Background()
		if form.encoding == binding.EncodingBinary {
			ctx = binding.WithForceBinary(ctx)
		} else {
			ctx = binding.WithForceStructured(ctx)
		}
		if result := client.Send(ctx, event); !cloudevents.IsACK(result) {
			fail("%s: not stored: %v", form.name, result)
		}
		sent = append(sent, describe(event))
	}
	if err := json.NewEncoder(os.Stdout).Encode(sent); err != nil {
		fail("print: %v", err)
	}
}

func sink() {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fail("listen: %v", err)
	}
	protocol, err := cloudevents.NewHTTP(cehttp.WithListener(listener))
	if err != nil {
		fail("protocol: %v", err)
	}
	client, err := cloudevents.NewClient(protocol)
	if err != nil {
		fail("client: %v", err)
	}
	fmt.Printf("listening %d\n", listener.Addr().(*net.TCPAddr).Port)
	out := json.NewEncoder(os.Stdout)
	err = client.StartReceiver(context.Background(), func(event cloudevents.Event) {
		if err := out.Encode(describe(event)); err != nil {
			fail("print: %v", err)
		}
	})
	if err != nil {
		fail("receive: %v", err)
	}
}

func main() {
	switch {
	case len(os.Args) == 4 && os.Args[1] == "publish":
		publish(os.Args[2], os.Args[3])
	case len(os.Args) == 2 && os.Args[1] == "sink":
		sink()
	default:
		fail("usage: eddy-sdk-go publish BUS_URL RUN_ID | eddy-sdk-go sink")
	}
}
