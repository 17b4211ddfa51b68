"""What drives a server from the outside, for the benchmarks, the demo and the tests: the load generator,
the /metrics scraper, one server-process launcher, loopback helpers and a process's memory."""
