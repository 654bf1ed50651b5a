// Package envoy is Envoy's life in the agent: the bootstrap the agent writes for it, its command
// line, and the Supervisor that starts it once a certificate is in service, forwards signals,
// drains it on shutdown and ends the agent with Envoy's exit status; Admin is the client of the
// admin API the agent asks whether Envoy is LIVE, how many connections it holds, to drain and to
// quit.
package envoy
