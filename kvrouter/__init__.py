"""kvrouter's composition root: the `kvrouter` command line, which wires events/, router/ and engine_stub/."""
