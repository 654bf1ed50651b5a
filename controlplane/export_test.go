package controlplane

// ShutdownGrace exposes how long in-flight requests may run once Run's context ends.
const ShutdownGrace = shutdownGrace
