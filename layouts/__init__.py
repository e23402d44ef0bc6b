"""Layout plugins: how a rank's KV tensors become KV regions."""
