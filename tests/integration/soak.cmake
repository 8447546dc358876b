# soak: 32 concurrent clients against a file-route and a shared-route kvshare-serve (fakes),
# mixed prompt lengths, streamed and whole replies, early disconnects; every reply correct
# and fds, threads, children, temp files (and RSS, within a margin) as before. CI runs 20 s;
# `python3 tests/integration/soak.py build/bin --seconds 120` is the long run.
add_test(NAME soak
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/soak.py ${CMAKE_BINARY_DIR}/bin --seconds 20)
set_tests_properties(soak PROPERTIES TIMEOUT 240 LABELS "soak;integration")
