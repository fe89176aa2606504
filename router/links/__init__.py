"""The links to engines: the fleet and its KV-event subscribers, discovery, embedded stubs."""
