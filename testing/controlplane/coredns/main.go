// Command coredns is CoreDNS with only the plugins the real node's Corefile uses (bind, errors,
// template, kubernetes), built in this module so it shares the control plane's Kubernetes
// libraries instead of compiling its own copy and CoreDNS's cloud plugins.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/template"
)

// The plugins' order in a server block's chain, as in CoreDNS's plugin.cfg.
var directives = []string{"bind", "errors", "template", "kubernetes"}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}
