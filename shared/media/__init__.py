"""Media: sources, fetching and decoding under the media policy."""
