"""kvrouter as a Gateway API endpoint picker: Envoy's ext_proc protocol over the gateway's routing."""
