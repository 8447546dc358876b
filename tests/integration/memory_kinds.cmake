# memory_kinds: recurrent (mamba2), hybrid (lfm2, qwen35) and iSWA (gemma3) models through
# the shared and the file route, with a llama-server built with the patch series
# (LLAMA_SERVER_KVSHARE=path) and its llama-kvshare-prefill. Exit 77 = skipped (no such server).
add_test(NAME llama_server_memory_kinds
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/memory_kinds.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(llama_server_memory_kinds PROPERTIES TIMEOUT 1200 SKIP_RETURN_CODE 77 LABELS llama_server)

# The same routes into the patched llama-server as a GPU decoder on a Vulkan device (issue
# #42; lavapipe in CI, GGML_VK_VISIBLE_DEVICES=0): exit 77 = skipped without such a device,
# except under CI=true, where it fails.
add_test(NAME llama_server_memory_kinds_vulkan
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/memory_kinds.py ${CMAKE_BINARY_DIR}/bin --vulkan)
set_tests_properties(llama_server_memory_kinds_vulkan PROPERTIES TIMEOUT 1800 SKIP_RETURN_CODE 77 LABELS "llama_server;vulkan")
