"""moerl's embedded engine: transformers' own model classes behind SGLang's HTTP protocol."""
