"""Small programs that the launch tests run on several ranks with intralayer.launch.run."""
