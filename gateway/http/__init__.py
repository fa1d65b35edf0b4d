"""The HTTP side: the aiohttp app, its routes and handlers, the generated OpenAPI document, the
server."""
